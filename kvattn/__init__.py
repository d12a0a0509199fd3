"""kvattn: an attention engine for LLM serving in CUDA-Python (the FlashInfer design, no PyTorch)."""
from ._errors import CompileError, CudaError, CudaUnavailableError, KvattnError
from ._driver import gpu_available
from .device import Device
from .memory import DeviceArray, Workspace, WorkspaceTooSmall, asarray, empty, from_numpy, zeros
from .stream import Event, Stream, default_stream
from .formats import BlockSparse, CascadeLevels, PagedKVLayout, PageTable, Ragged, pack_mask, unpack_mask
from .merge import merge_state, merge_state_in_place, merge_states
from .decode import BatchDecodeWithPagedKVCache, single_decode
from .prefill import BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache, single_prefill
from .cascade import MultiLevelCascadeAttentionWrapper
from .page import append_paged_kv_cache, get_batch_indices_positions
from .block_sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper
from .mixed import BatchMixedWithPagedKVCache
from .variants import RoPE, Variant
from . import device, graphs, reference, scheduler

__version__ = "0.1.0"
