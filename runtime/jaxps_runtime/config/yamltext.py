"""YAML read as Kubernetes reads it.

PyYAML implements YAML 1.1, where a number with an exponent and no dot (`5e-05`, `1e+30`,
`1.0e30`) is a string; kubectl and the API server read manifests as YAML 1.2 (through JSON),
where it is a float, and so does Python's `json.dumps` write small and large floats. A
learning rate of 5e-05 must mean the same to `jaxps validate`, `jaxps local` and a cluster:
`Loader` is PyYAML's safe loader (libyaml's where it is there) that also takes those as floats.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loader(_Base):  # type: ignore[misc]
    """The safe loader, with YAML 1.2's floats."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

Error = yaml.YAMLError


def load(text: str) -> Any:
    """One YAML (or JSON) document."""
    return yaml.load(text, Loader=Loader)  # a safe loader


def load_all(text: str) -> list[Any]:
    """Every document of a YAML stream."""
    return list(yaml.load_all(text, Loader=Loader))  # a safe loader
