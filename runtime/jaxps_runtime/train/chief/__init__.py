"""The chief (or worker 0 when the job has no chief): coordinates a job from start to end.

1. Serves the Coordinator service on its own address, so tasks can register and heartbeat
   (`job`).
2. Waits for every ps, logging which task at which address it waits for (research pitfall 2).
3. Initialises the variables from the seed, with the mode and the workers, at epoch 1 (or
   adopts or restores them: `coordination`).
4. Watches (`coordination`): logs step, loss and steps per second (and, with
   `training.tensorboard`, writes them with examples per second and the pull/compute/push
   split of a step to TensorBoard event files: `progress`); a worker silent for
   `workerTimeoutSeconds` is dropped from the live set the ps tasks aggregate over (sync never
   hangs on a dead worker); checkpoints periodically (`checkpointer`).
5. At `steps` (`finish`): waits for the workers and the evaluator to finish, evaluates (unless
   an evaluator did; the chief's own evaluation goes to TensorBoard's eval run too), writes
   the parameters to `exportPath` if set, prints one JSON summary as its last line on stdout
   (also to the termination log when that file exists, as Kubernetes reads it:
   `termination`), then tells every task to stop and shuts every ps down so none lingers.
Told to stop (SIGTERM or SIGINT, `stopping`), it ends its waits and calls and exits with
`stopping.Stopped`, leaving the ps tasks serving (never Shutdown: a replacement chief adopts
their state) and committing no checkpoint it has not got every shard of. On SIGTERM (a
preemption: Kueue's, through the operator) with a checkpoint directory, it first commits a
checkpoint of the step the ps tier holds, within a deadline (`preemption`).
"""

from jaxps_runtime.train.chief.job import Chief

__all__ = ["Chief"]
