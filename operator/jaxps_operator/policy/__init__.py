"""The job's policies, one module each (as JobSet keeps them): restart, success, deadline and
TTL, suspend, cleanup, schedule (pods that wait) and stall (the Stalled backstop). Each is
pure: it reads the job and what was observed, and writes to the pass's `Status` and `Plan`."""
