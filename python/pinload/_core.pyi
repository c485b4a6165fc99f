"""Type stub of pinload._core, the native module (src/python/bindings.cc)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__version__: str
DEFAULT_THREADS: int
DEFAULT_BLOCK_SIZE: int
DEFAULT_STREAMS: int
DEFAULT_CHUNK_BYTES: int
DEFAULT_STAGING_BYTES: int

class Error(Exception):
    """Base class of every pinload error."""

    code: str  # "invalid_file", "not_found", "io", "out_of_memory", "device", "cancelled"
    message: Optional[str]  # the text without the file/tensor context
    file: Optional[str]
    tensor: Optional[str]
    begin: Optional[int]  # byte offsets in the file, where they apply
    end: Optional[int]

class InvalidFileError(Error, ValueError): ...
class NotFoundError(Error, FileNotFoundError): ...
class IoError(Error, OSError): ...
class OutOfMemoryError(Error, MemoryError): ...
class DeviceError(Error): ...
class CancelledError(Error): ...

# (name, safetensors dtype, shape, DLPack capsule of the tensor's bytes as 1-D uint8, or None
# for a tensor without bytes)
Export = Tuple[str, str, List[int], Optional[object]]

class StateDict:
    """A loaded checkpoint: tensors in pool or device memory. Exported capsules keep their memory
    alive on their own; the StateDict may be dropped at any time."""

    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...
    def names(self) -> List[str]: ...
    def metadata(self) -> Dict[str, str]: ...
    def infos(self) -> List[Tuple[str, str, List[int]]]: ...
    def export(self, name: str) -> Export: ...
    def export_all(self) -> List[Export]: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def device(self) -> str: ...  # "cpu", "sim", "cuda:N"
    @property
    def torch_device(self) -> str: ...  # "cpu" or "cuda:N"

class LoadHandle:
    """A load in flight; dropping it cancels the load."""

    def done(self) -> bool: ...
    def cancel(self) -> None: ...
    def progress(self) -> Dict[str, int]: ...
    def wait(self, timeout: Optional[float] = None) -> bool: ...
    def result(self) -> StateDict: ...
    def next_ready(self, timeout: Optional[float] = None) -> Optional[StateDict]: ...
    @property
    def device(self) -> str: ...

class Prefetch:
    """Reads started before the load that adopts them; dropping it stops it and frees its memory."""

    def done(self) -> bool: ...
    def cancel(self) -> None: ...
    def progress(self) -> Dict[str, int]: ...
    def wait(self, timeout: Optional[float] = None) -> bool: ...
    @property
    def adopted(self) -> bool: ...
    @property
    def device(self) -> str: ...
    @property
    def paths(self) -> List[str]: ...

def load_async(
    paths: Sequence[Union[bytes, str]],
    device: str = "cpu",
    threads: int = ...,
    block_size: int = ...,
    direct: str = "auto",
    files_in_flight: int = 2,
    streams: int = ...,
    chunk_bytes: int = ...,
    staging_bytes: Optional[int] = None,
    variant: str = "",
    prefetch: Optional[Prefetch] = None,
    dtype: str = "",
    keep: Sequence[str] = ...,
    keep_dtype: str = "",
    cached_read: str = "auto",
    stream: bool = False,
    pool_bytes: Optional[int] = None,
    held: Optional["HeldFile"] = None,
) -> LoadHandle: ...
class HeldFile:
    """One file held open from its header read to its load (what safe_open reads through)."""
    def __init__(self, path: bytes) -> None: ...
    def header(self) -> Dict[str, Any]: ...
def convert(
    input: bytes,
    output: bytes,
    to: str = "fp8-e4m3fn",
    scale: str = "per-tensor",
    keep: Sequence[str] = ...,
    threads: int = 8,
    variant: str = "",
) -> Dict[str, Any]: ...
def load_now(
    paths: Sequence[Union[bytes, str]],
    device: str = "cpu",
    threads: int = ...,
    block_size: int = ...,
    direct: str = "auto",
    files_in_flight: int = 2,
    streams: int = ...,
    chunk_bytes: int = ...,
    staging_bytes: Optional[int] = None,
    variant: str = "",
    dtype: str = "",
    keep: Sequence[str] = ...,
    keep_dtype: str = "",
    cached_read: str = "auto",
    pool_bytes: Optional[int] = None,
) -> StateDict: ...
def load_batch(
    paths: Sequence[Union[bytes, str]],
    device: str = "cpu",
    threads: int = ...,
    block_size: int = ...,
    direct: str = "auto",
    files_in_flight: int = 2,
    streams: int = ...,
    chunk_bytes: int = ...,
    staging_bytes: Optional[int] = None,
    variant: str = "",
    cached_read: str = "auto",
    pool_bytes: Optional[int] = None,
) -> List[Union[StateDict, Error]]: ...
def prefetch(
    paths: Sequence[Union[bytes, str]],
    device: str = "cpu",
    threads: int = ...,
    block_size: int = ...,
    direct: str = "auto",
    files_in_flight: int = 2,
    streams: int = ...,
    chunk_bytes: int = ...,
    staging_bytes: Optional[int] = None,
    variant: str = "",
) -> Prefetch: ...
class ModelCache:
    """Host copies of recently used checkpoints in the shared pool of `pool_device`, LRU under
    `budget_bytes` (include/pinload/model_cache.h)."""

    def __init__(
        self,
        budget_bytes: int,
        pool_device: str = "cpu",
        threads: int = ...,
        block_size: int = ...,
        direct: str = "auto",
        files_in_flight: int = 2,
        variant: str = "",
    ) -> None: ...
    def get(
        self, paths: Sequence[Union[bytes, str]], device: str = "cpu", streams: int = ..., chunk_bytes: int = ...
    ) -> StateDict: ...
    def contains(self, paths: Sequence[Union[bytes, str]]) -> bool: ...
    def evict(self, paths: Sequence[Union[bytes, str]]) -> bool: ...
    def clear(self) -> None: ...
    def set_budget(self, budget_bytes: int) -> None: ...
    def stats(self) -> Dict[str, int]: ...

def read_header(path: Union[bytes, str]) -> Dict[str, Any]: ...
def pool_stats(device: str = "cpu") -> Dict[str, Union[int, str]]: ...
def trim_pool(device: str = "cpu") -> None: ...
def dtype_names() -> List[str]: ...
def built_with_cuda() -> bool: ...
def cuda_available() -> Tuple[bool, str]: ...
