from jaxps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PsState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PS_STATE_UNSPECIFIED: _ClassVar[PsState]
    UNINITIALIZED: _ClassVar[PsState]
    ASSIGNING: _ClassVar[PsState]
    READY: _ClassVar[PsState]
    SHUTTING_DOWN: _ClassVar[PsState]

class TrainingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINING_MODE_UNSPECIFIED: _ClassVar[TrainingMode]
    ASYNC: _ClassVar[TrainingMode]
    SYNC: _ClassVar[TrainingMode]
    BOUNDED_STALENESS: _ClassVar[TrainingMode]
PS_STATE_UNSPECIFIED: PsState
UNINITIALIZED: PsState
ASSIGNING: PsState
READY: PsState
SHUTTING_DOWN: PsState
TRAINING_MODE_UNSPECIFIED: TrainingMode
ASYNC: TrainingMode
SYNC: TrainingMode
BOUNDED_STALENESS: TrainingMode

class StatusRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("id", "state", "step", "tensors", "counters", "optimizer", "mode", "awaiting", "cursors", "bulk_port")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CursorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    AWAITING_FIELD_NUMBER: _ClassVar[int]
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    state: PsState
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    counters: _containers.ScalarMap[str, float]
    optimizer: str
    mode: TrainingMode
    awaiting: int
    cursors: _containers.ScalarMap[str, int]
    bulk_port: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., state: _Optional[_Union[PsState, str]] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., optimizer: _Optional[str] = ..., mode: _Optional[_Union[TrainingMode, str]] = ..., awaiting: _Optional[int] = ..., cursors: _Optional[_Mapping[str, int]] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("id", "tensors", "optimizer", "step", "mode", "replicas_to_aggregate", "max_staleness", "last_step", "workers")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    optimizer: str
    step: int
    mode: TrainingMode
    replicas_to_aggregate: int
    max_staleness: int
    last_step: int
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., optimizer: _Optional[str] = ..., step: _Optional[int] = ..., mode: _Optional[_Union[TrainingMode, str]] = ..., replicas_to_aggregate: _Optional[int] = ..., max_staleness: _Optional[int] = ..., last_step: _Optional[int] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class SetWorkersRequest(_message.Message):
    __slots__ = ("id", "workers")
    ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("id", "state", "missing")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    state: PsState
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., state: _Optional[_Union[PsState, str]] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("id", "names", "selections", "min_step")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SELECTIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    names: _containers.RepeatedScalarFieldContainer[str]
    selections: _containers.RepeatedCompositeFieldContainer[RowSelection]
    min_step: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., names: _Optional[_Iterable[str]] = ..., selections: _Optional[_Iterable[_Union[RowSelection, _Mapping]]] = ..., min_step: _Optional[int] = ...) -> None: ...

class RowSelection(_message.Message):
    __slots__ = ("name", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: bytes
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[bytes] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("id", "step", "directory")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    directory: str
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ..., directory: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("id", "step", "file", "sha256", "cursors")
    class CursorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    file: str
    sha256: str
    cursors: _containers.ScalarMap[str, int]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., sha256: _Optional[str] = ..., cursors: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("id", "step", "file", "sha256", "bytes", "cursors")
    class CursorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    file: str
    sha256: str
    bytes: int
    cursors: _containers.ScalarMap[str, int]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., cursors: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    reason: str
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ("id", "step")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...
