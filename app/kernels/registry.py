"""The one registry of choices: every kernel and weight form the engine runs, in the order it
prefers them, each saying what it accepts (`accepts(request)`: None, or why not) and how it is
built (`build(request)`). The first entry of an op that accepts a request (and builds, where a
form can still decline once it looked at the numbers) is the choice. A model's plan
(`runtime/kernel_plan.py`), `Linear`'s forms and the token table (`runtime/weight_forms.py`) and
the per-call attention dispatch (`app.kernels.unified_attention`, `store_kv`) all ask here;
`localbatch doctor` prints the plan it gives on the machine.

| op | entries, in order | request |
|---|---|---|
| `attention` | `triton`, `c`, `torch` | `AttentionRequest` |
| `row_ops` | `c`, `torch` | `RowRequest` |
| `weight` (every row count) | `q4k`, `q4`, `q5`, `q6`, `split`, `q8`: the C kernels' groups | `WeightRequest` |
| `weight_many_rows` | `fp16` (fbgemm), `tensor` | `WeightRequest` |
| `weight_few_rows` (up to the measured crossover) | `int4`, `int8` | `WeightRequest` |
| `embedding` | `table`, `head`, `q4k`, `q4`, `q5`, `q6`, `fp16`, `fp32` | `EmbeddingRequest` |

The C attention is two kernels with requirements of their own: paged attention and the KV store
(`PAGED_C`: a head size of whole 8-lane vectors, at most 128 query heads) and the fused q/k norm,
RoPE and store over the qkv projection (`ROPE_C`: a head size of whole 16-lane halves, at most 512,
the kernel's row buffers). A model's attention block runs both, so its request (`rope=True`)
needs both; a plain per-call attention or store needs the first.

The environment variables that steer the choices are read in one place (`settings.py`, which says
what each value does): `LOCALBATCH_LINEAR_KERNEL` (auto | dense | packed), `LOCALBATCH_CPU_QUANT_KERNELS`
(0: no C groups), `LOCALBATCH_CPU_ATTENTION` (torch: the reference attention) and `LOCALBATCH_CPU_ISA`
(avx2: the AVX2 GEMM tiles; read by the C library itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from app.kernels import cpu_attention, cpu_build, cpu_ops, cpu_qgemm
from app.kernels.cpu_qgemm import GROUP, C_FORMS, Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight, SplitWeight
from app.kernels.settings import ATTENTION_ENV, LINEAR_KERNEL_ENV, QUANT_KERNELS_ENV, KernelSettings
from app.kernels.torch_weights import Fp16Weight, Int4Weight, Int8Weight


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the Triton kernels can run here: Triton imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Entry:
    """One way to do an op: its name, what it accepts (None: yes; else why not, for people) and how
    it is built from the request (None from `build`: declined after looking, the next entry tries)."""

    op: str
    name: str
    accepts: Callable[[Any], str | None]
    build: Callable[[Any], Any] | None = None
    doc: str = ""


# ---- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionRequest:
    """An attention call (or a model's attention block, `rope=True`): the queries' device and dtype,
    the cache's dtype, the query heads and head size; `scales`: whether an int8 cache's scales came
    with a call (None for a model: its int8 pools always have them)."""

    device: str
    dtype: torch.dtype
    cache_dtype: torch.dtype
    heads: int
    head_dim: int
    rope: bool = False
    scales: bool | None = None
    settings: KernelSettings = field(default_factory=KernelSettings)


@dataclass(frozen=True)
class RowRequest:
    """A model's row ops: compute device and dtype, every row width they see, the MLP activation."""

    device: str
    dtype: torch.dtype
    widths: tuple[int, ...]
    act: str


class WeightSource(Protocol):
    """A matrix as the forms read it (`runtime/weight_forms.Source`): its shape, dtype and device;
    `layout()`, the grid its file holds it on ("q4k", "q4", "q5", "q6"; "mixed": parts on several;
    None) and `blocks()`, that grid's numbers; `runs()`, a mixed matrix's runs of parts of one grid;
    `rows(start, end)` in fp32; `dense()`, the whole of it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def layout(self) -> str | None: ...

    def blocks(self) -> Any: ...

    def runs(self) -> Sequence[WeightSource]: ...

    def rows(self, start: int, end: int) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class WeightRequest:
    """A matrix to take its forms: `packing` False keeps the tensor only (`Linear(allow_packed=False)`),
    `requantize_int4` lets the int4 form round a matrix that is not on a 4-bit grid (a large head)."""

    source: WeightSource
    settings: KernelSettings = field(default_factory=KernelSettings)
    packing: bool = True
    requantize_int4: bool = False

    def part(self, source: WeightSource) -> WeightRequest:
        return WeightRequest(source, self.settings, self.packing, self.requantize_int4)


@dataclass(frozen=True)
class EmbeddingRequest:
    """The token table: its source, whether it is tied to the output projection, what that head was
    given (`head_tensor`: it keeps its tensor; `head_groups`: the C kernels' groups are its only
    copy) and the head's forms themselves (`head`: weight, packed; None when only planning)."""

    source: Any  # a WeightSource, plus fits_fp16()
    tied: bool
    head_tensor: bool
    head_groups: bool
    head: Any = None

    @classmethod
    def of(cls, source: Any, head: Any, tied: bool) -> EmbeddingRequest:
        groups = isinstance(head.packed, C_FORMS) and head.dense is None
        return cls(source, tied, head.weight is not None, groups, head)


# ---- what each kernel accepts ----------------------------------------------------------------------


def _library_reason(what: str) -> str:
    return cpu_build.library().reason or f"the {what} did not load"


def paged_c(req: AttentionRequest) -> str | None:
    """Paged attention and the KV store in C: fp32 CPU queries over an fp32, fp16 or int8 cache (int8
    with its scales), a head size of whole 8-lane vectors, at most 128 query heads, built and not
    turned off."""
    if req.device != "cpu":
        return f"{req.device} tensors"
    if req.dtype != torch.float32:
        return f"{_dtype(req.dtype)} compute (fp32 only)"
    if req.cache_dtype not in cpu_attention.CACHE_DTYPES:
        return f"the C attention reads fp32, fp16 or int8 KV caches, not {_dtype(req.cache_dtype)}"
    if req.scales is not None and req.scales != (req.cache_dtype == torch.int8):
        return "an int8 cache comes with its scales, another without"
    if req.head_dim % 8:
        return f"head size {req.head_dim} is not whole 8-lane vectors"
    if req.heads > cpu_attention.MAX_HEADS:
        return f"{req.heads} query heads (at most {cpu_attention.MAX_HEADS})"
    if not req.settings.c_attention:
        return f"{ATTENTION_ENV}=torch"
    return None if cpu_attention.library() is not None else _library_reason("C attention")


def rope_c(req: AttentionRequest) -> str | None:
    """The q/k norm, RoPE and KV store pass in C: its rotation reads 16-lane halves and its row
    buffers hold 512 values."""
    if req.head_dim % 16 or req.head_dim > 512:
        return f"head size {req.head_dim}: the fused RoPE pass takes multiples of 16 up to 512"
    return None


def _c_attention(req: AttentionRequest) -> str | None:
    return paged_c(req) or (rope_c(req) if req.rope else None)


def _triton(req: AttentionRequest) -> str | None:
    if req.device != "cuda":
        return "CUDA only"
    return None if triton_available() else "Triton is not installed"


def _row_ops_c(req: RowRequest) -> str | None:
    if req.device != "cpu" or req.dtype != torch.float32:
        return f"{req.device} {_dtype(req.dtype)} compute (fp32 CPU only)"
    odd = [w for w in req.widths if w % 8]
    if odd:
        return f"row widths {odd} are not whole 8-lane vectors"
    if req.act not in cpu_ops.GLU_ACTIVATIONS:
        return f"no C kernel for the {req.act} activation"
    return None if cpu_ops.library() is not None else _library_reason("C row ops")


def _always(req: Any) -> None:
    return None


# ---- weight forms ----------------------------------------------------------------------------------


def groups_reason(req: WeightRequest) -> str | None:
    """Whether a matrix takes the C kernels' groups: fp32 compute on a CPU, whole groups of 32 along
    its rows, the GEMM built and not turned off."""
    src, settings = req.source, req.settings
    if not req.packing or settings.dense_forced:
        return f"{LINEAR_KERNEL_ENV}=dense" if settings.dense_forced else "kept as the tensor"
    if src.device.type != "cpu" or src.dtype != torch.float32:
        return f"{src.device.type} {_dtype(src.dtype)} compute (fp32 CPU only)"
    if not settings.quant_kernels:
        return f"{QUANT_KERNELS_ENV}=0"
    if cpu_qgemm.library() is None:
        return _library_reason("C GEMM")
    return None if src.shape[1] % GROUP == 0 else f"rows of {src.shape[1]}, not whole groups of {GROUP}"


def takes_groups(device: torch.device, dtype: torch.dtype, settings: KernelSettings | None = None) -> bool:
    """Whether matrices on `device` in `dtype` take the C kernels' groups (so the loader hands out
    their blocks)."""
    settings = settings or KernelSettings.from_env()
    return (device.type == "cpu" and dtype == torch.float32 and settings.quant_kernels
            and cpu_qgemm.library() is not None)


def _at_layout(name: str) -> Callable[[WeightRequest], str | None]:
    def accepts(req: WeightRequest) -> str | None:
        reason = groups_reason(req)
        if reason is None and req.source.layout() != name:
            return f"not on a {name} grid"
        return reason

    return accepts


def _q4k(b: Any) -> Q4KWeight:
    if hasattr(b, "levels"):  # the file's grid, a level a byte
        return Q4KWeight(b.levels, b.d, b.dmin, b.scales, b.mins)
    return Q4KWeight.from_nibbles(b.nibbles, b.d, b.dmin, b.scales, b.mins)


def _q4(b: Any) -> Q4Weight:
    return Q4Weight(b.levels, b.step, b.low) if hasattr(b, "levels") else Q4Weight.from_nibbles(b.nibbles, b.step, b.low)


def _q5(b: Any) -> Q5Weight:
    return Q5Weight(b.levels, b.step, b.low)


def _q6(b: Any) -> Q6Weight:
    return Q6Weight(b.levels, b.scales, b.d) if hasattr(b, "levels") else Q6Weight.from_parts(b.nibbles, b.top, b.scales, b.d)


FILE_GRIDS: dict[str, Callable[[Any], Any]] = {"q4k": _q4k, "q4": _q4, "q5": _q5, "q6": _q6}


def _split(req: WeightRequest) -> str | None:
    reason = groups_reason(req)
    if reason is not None:
        return reason
    if req.source.layout() != "mixed":
        return "not parts of several grids"
    runs = req.source.runs()
    if not 2 <= len(runs) <= cpu_qgemm.MAX_PARTS:
        return f"{len(runs)} runs of parts (2 to {cpu_qgemm.MAX_PARTS})"
    if all(choose("weight", req.part(run)).name == "q8" for run in runs):
        return "no part at its file's bits"
    return None


def _build_split(req: WeightRequest) -> SplitWeight:
    return SplitWeight([build("weight", req.part(run))[1] for run in req.source.runs()])


def _torch_packed(req: WeightRequest, dtype: torch.dtype, only: str, available: Callable[[], bool],
                  missing: str) -> str | None:
    """Why a torch-packed form of a `dtype` CPU weight does not apply (None: it does)."""
    if not req.packing or req.settings.dense_forced:
        return f"{LINEAR_KERNEL_ENV}=dense" if req.settings.dense_forced else "kept as the tensor"
    if req.source.device.type != "cpu" or req.source.dtype != dtype:
        return only
    return None if available() else missing


def _fp16(req: WeightRequest) -> str | None:
    return _torch_packed(req, torch.float32, "fp32 CPU compute only", Fp16Weight.available,
                         "this torch has no fbgemm fp16 GEMM")


def _few_rows(req: WeightRequest) -> str | None:
    return _torch_packed(req, torch.bfloat16, "bf16 CPU compute only", Int8Weight.available,
                         "this torch has no int8 weight GEMM")


def _int4(req: WeightRequest) -> Int4Weight | None:
    weight = req.source.dense()
    return Int4Weight.from_grid(weight) or (Int4Weight.requantized(weight) if req.requantize_int4 else None)


# ---- the token table -------------------------------------------------------------------------------


def _table(req: EmbeddingRequest) -> str | None:
    if req.source.dtype != torch.float32 or req.head_tensor:
        return None
    return "fp32 compute whose head keeps no tensor: rows are read from groups or a smaller copy"


def _head_rows(req: EmbeddingRequest) -> str | None:
    if not req.tied:
        return "its own table, not the head's"
    if not req.head_groups:
        return "the head has no C kernels' groups"
    return None


def _table_at(name: str) -> Callable[[EmbeddingRequest], str | None]:
    def accepts(req: EmbeddingRequest) -> str | None:
        return None if req.source.layout() == name else f"not on a {name} grid"

    return accepts


def _fp16_table(req: EmbeddingRequest) -> str | None:
    return None if req.source.fits_fp16() else "values beyond fp16's range"


def _embedding_entries() -> list[Entry]:
    tables = [Entry("embedding", name, _table_at(name), lambda r, make=make: (None, make(r.source.blocks())),
                    f"the table's own {name} groups, rows read from them")
              for name, make in FILE_GRIDS.items()]
    return [
        Entry("embedding", "table", _table,
              lambda r: (r.head.weight if r.tied and r.head.weight is not None else r.source.dense(), None),
              "the tensor (the head's where tied): bf16/CUDA compute, or a head kept dense"),
        Entry("embedding", "head", _head_rows, lambda r: (None, r.head.packed),
              "a tied table's rows read from the head's groups: no second copy"),
        *tables,
        Entry("embedding", "fp16", _fp16_table, lambda r: (r.source.dense().half(), None), "an fp16 copy"),
        Entry("embedding", "fp32", _always, lambda r: (r.source.dense(), None), "the fp32 table"),
    ]


def _weight_entries() -> list[Entry]:
    grids = [Entry("weight", name, _at_layout(name), lambda r, make=make: make(r.source.blocks()),
                   f"C GEMM on the file's own {name} groups")
             for name, make in FILE_GRIDS.items()]
    return [
        *grids,
        Entry("weight", "split", _split, _build_split, "C GEMM, each run of a fused matrix's parts in its own form"),
        Entry("weight", "q8", groups_reason, lambda r: Q8Weight.from_rows(tuple(r.source.shape), r.source.rows),
              "C GEMM on 8-bit groups requantized from the rows"),
        Entry("weight_many_rows", "fp16", _fp16, lambda r: Fp16Weight(r.source.dense()), "fbgemm's fp16 GEMM"),
        Entry("weight_many_rows", "tensor", _always, lambda r: r.source.dense(), "F.linear on the tensor"),
        Entry("weight_few_rows", "int4", _few_rows, _int4, "torch's int4 GEMM: a 4-bit source (or a large head)"),
        Entry("weight_few_rows", "int8", _few_rows, lambda r: Int8Weight(r.source.dense()), "torch's int8 GEMM"),
    ]


ENTRIES: tuple[Entry, ...] = (
    Entry("attention", "triton", _triton, doc="Triton paged attention and KV store (CUDA)"),
    Entry("attention", "c", _c_attention, doc="C paged attention, KV store and fused RoPE pass (fp32 CPU)"),
    Entry("attention", "torch", _always, doc="the torch reference"),
    Entry("row_ops", "c", _row_ops_c, doc="C RMS norm, residual add and GLU (fp32 CPU)"),
    Entry("row_ops", "torch", _always, doc="torch's F.rms_norm, F.silu / F.gelu"),
    *_weight_entries(),
    *_embedding_entries(),
)
OPS = tuple(dict.fromkeys(e.op for e in ENTRIES))


def entries(op: str) -> tuple[Entry, ...]:
    found = tuple(e for e in ENTRIES if e.op == op)
    if not found:
        raise ValueError(f"no op named {op!r} in the registry ({', '.join(OPS)})")
    return found


def verdicts(op: str, request: Any) -> list[tuple[Entry, str | None]]:
    """Every entry of `op` with why it does not take `request` (None where it does), in order."""
    return [(e, e.accepts(request)) for e in entries(op)]


def choose(op: str, request: Any) -> Entry | None:
    """The first entry of `op` that accepts `request` (None: none does)."""
    return next((e for e in entries(op) if e.accepts(request) is None), None)


def build(op: str, request: Any) -> tuple[Entry, Any] | None:
    """The first entry of `op` that accepts `request` and builds it, with what it built."""
    for entry in entries(op):
        if entry.accepts(request) is None:
            built = entry.build(request)
            if built is not None:
                return entry, built
    return None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
