from jaxps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("id", "task_incarnation")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    task_incarnation: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., task_incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "task_incarnation", "step", "loss", "done", "metrics", "examples_per_second", "waiting")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    task_incarnation: int
    step: int
    loss: float
    done: bool
    metrics: _containers.ScalarMap[str, float]
    examples_per_second: float
    waiting: str
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., task_incarnation: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., done: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., examples_per_second: _Optional[float] = ..., waiting: _Optional[str] = ...) -> None: ...

class CoordinatorState(_message.Message):
    __slots__ = ("id", "step", "stop", "live_workers")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    stop: bool
    live_workers: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ..., stop: _Optional[bool] = ..., live_workers: _Optional[int] = ...) -> None: ...
