"""The weight matrices of the lean CPU forward (engine.model.lean_cpu), in one of three forms with
one interface, products of rows x [n, in]:

- `Fp32Matrix`: the fp32 values, stored contiguous as [in, out] and used through the [out, in]
  transposed view: MKL's matrix-vector product streams that layout faster than the [out, in]
  contiguous one, and one row (a decode step) takes that product.
- `Int8Matrix`: weight-only int8 with one scale per output row (as gpt-fast's int8 mode), multiplied
  by torch's `_weight_int8pack_mm` with the activations in bf16 and fp32 sums inside. A decode step
  on a small CPU is bound by the bytes of weights it streams, and int8 moves a quarter of fp32's.
  The cost is rounding: a row's weights to 1/254 of its largest, the activations and results to
  bf16 (relative 2^-9). That rounding changes some greedy completions of wd-coder-tiny (whose FP8
  blocks int8 rows cannot represent), so int8 is opt-in; fp32 is the default for such models.
- `Int4Matrix`: int4 values with one scale per group of input columns, the checkpoint format of a
  model trained through int4 rounding (engine.loading.int4), multiplied by torch's
  `_weight_int4pack_mm_for_cpu` with bf16 activations. For such a model it holds the weights
  exactly (our int4 quantizer gives back the same values and scales for weights it wrote), so it
  streams an eighth of fp32's bytes at the cost of activation rounding alone. `int4_codes` says
  whether a model's matrices are of that kind; the form refuses a matrix that is not.

- `ModelFp32Matrix`: the model's own fp32 [out, in] weights, read in place: the int4 form's exact
  recompute of the steps its rounding could decide otherwise (engine.model.lean_cpu), which costs
  no memory beyond the model's and is slower per product than `Fp32Matrix`'s copy.

An RMSNorm weight in front of a product can be folded into its columns (`in_scale`), so the norm
is one scalar. Both are derived from the weights when built; weights changed later are not seen
(nothing in the engine changes them).
"""

from __future__ import annotations

import functools

import torch

FORMS = ("int8", "fp32", "int4")
MODEL_FP32 = "model-fp32"  # the exact recompute's form (`ModelFp32Matrix`), never a user's choice
# The dtype each form takes its activations in: converting a vector once, for all the products
# it feeds, saves a conversion per product.
# int4 takes fp32: its products scale the activations first (the norm weight it cannot fold), and
# one rounding to bf16 after that scale is the kernel's only input rounding.
INPUT_DTYPE = {
    "int8": torch.bfloat16,
    "fp32": torch.float32,
    "int4": torch.float32,
    MODEL_FP32: torch.float32,
}
INT4_GROUPS = (32, 64, 128)  # the group sizes engine.loading.int4 writes that the kernel takes
INT4_MAX = 7  # the largest magnitude of each group's values, as that quantizer writes them


class Fp32Matrix:
    __slots__ = ("t",)

    def __init__(self, w: torch.Tensor, in_scale: torch.Tensor | None = None):
        """w [out, in] fp32, times in_scale [in] per column."""
        t = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
        if in_scale is None:
            t.copy_(w.t())
        else:
            torch.mul(w.t(), in_scale[:, None], out=t)
        self.t = t.t()  # the [out, in] values, as a view of the [in, out] storage

    @property
    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for one row x [in] (a matrix-vector product) or rows x [n, in]: [..., out]."""
        if x.dim() == 1:
            return torch.mv(self.t, x)
        return torch.mm(x, self.t.t())

    def addmm(self, add: torch.Tensor, x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """add + alpha x W^T, the add inside the product; add [out] or [n, out]."""
        if x.dim() == 1:
            return torch.addmv(add, self.t, x, alpha=alpha)
        if alpha == 1.0:  # a product without alpha dispatches faster
            return torch.addmm(add, x, self.t.t())
        return torch.addmm(add, x, self.t.t(), alpha=alpha)


class ModelFp32Matrix:
    __slots__ = ("w", "in_scale")

    def __init__(self, w: torch.Tensor, in_scale: torch.Tensor | None = None):
        """w [out, in] fp32, not copied; in_scale [in] multiplies the activations instead of
        being folded into a copy of w."""
        self.w, self.in_scale = w, in_scale

    nbytes = 0  # the model's own tensors

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.in_scale is None else x * self.in_scale

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for one row x [in] or rows x [n, in]: [..., out]."""
        x = self._scaled(x)
        return torch.mv(self.w, x) if x.dim() == 1 else torch.mm(x, self.w.t())

    def addmm(self, add: torch.Tensor, x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """add + alpha x W^T; add [out] or [n, out]."""
        x = self._scaled(x)
        if x.dim() == 1:
            return torch.addmv(add, self.w, x, alpha=alpha)
        return torch.addmm(add, x, self.w.t(), alpha=alpha)


class _KernelMatrix:
    """A form whose product is a kernel with bf16 results (`mm`): the add happens after it."""

    __slots__ = ()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def addmm(self, add: torch.Tensor, x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """add + alpha x W^T (fp32 where add is)."""
        if alpha == 1.0:  # an add without alpha dispatches faster
            return torch.add(add, self.mm(x))
        return torch.add(add, self.mm(x), alpha=alpha)


class Int8Matrix(_KernelMatrix):
    __slots__ = ("q", "scale")

    def __init__(self, w: torch.Tensor, in_scale: torch.Tensor | None = None):
        w = (w * in_scale) if in_scale is not None else w.float()
        amax = w.abs().amax(dim=1)
        # bf16 scales (the kernel's), at least normal: an all-zero row then stays all zero.
        scale = (amax / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        self.q = (
            torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        )
        self.scale = scale

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2

    # Results are bf16 (the kernel's): where one feeds another product it needs no conversion,
    # and an add into fp32 promotes it inside the add. x in bf16 saves a conversion.
    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for one row x [in] or rows x [n, in]: [..., out]."""
        rows = x if x.dim() == 2 else x[None]  # the kernel takes rows
        y = torch._weight_int8pack_mm(
            rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16), self.q, self.scale
        )
        return y if x.dim() == 2 else y[0]


class Int4Matrix(_KernelMatrix):
    __slots__ = ("packed", "scales_and_zeros", "group", "in_scale")

    def __init__(
        self,
        w: torch.Tensor,
        group: int,
        in_scale: torch.Tensor | None = None,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """w [out, in] fp32 whose values are int4 groups of `group` columns exactly (the model
        was trained through them); in_scale [in] multiplies the activations, since folded into
        the columns it would leave the int4 grid. `codes`: w's (values, scales), where
        `int4_codes` has found them already."""
        q, scale = codes if codes is not None else _exact_int4(w, group)
        if q is None:
            raise ValueError(
                f"a [{w.shape[0]}, {w.shape[1]}] matrix is not int4 groups of {group} exactly "
                "(or its rows are not a multiple of 16): its model was not trained through them"
            )
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 2)
        # [in / group, out, 2]: each group's scale and a zero point of 0 (symmetric values).
        self.scales_and_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).to(
            torch.bfloat16
        )
        self.group = group
        self.in_scale = None if in_scale is None else in_scale.float()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_and_zeros.numel() * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for one row x [in] or rows x [n, in]: [..., out], bf16 (the kernel's)."""
        rows = x if x.dim() == 2 else x[None]
        if self.in_scale is not None:  # scaled in fp32, then rounded once
            rows = rows.float() * self.in_scale
        rows = rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group, self.scales_and_zeros
        )
        return y if x.dim() == 2 else y[0]


def _exact_int4(w: torch.Tensor, group: int):
    """(values int8 [out, in], scales fp32 [out, in / group]) of w as symmetric int4 groups whose
    largest magnitude is 7 (as the project's quantizer writes them, engine.loading.int4) when
    they give back w exactly, with scales exact in bf16 (the kernel's), and the CPU kernel takes
    w's shape; (None, None) otherwise."""
    if w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % group or group % 8:
        return None, None
    groups = w.float().unflatten(1, (-1, group))
    amax = groups.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    q = groups / scale[..., None]
    exact = (
        torch.equal(q, q.round())
        and torch.equal(q * scale[..., None], groups)
        and torch.equal(scale.to(torch.bfloat16).float(), scale)
    )
    return (q.flatten(1).to(torch.int8), scale) if exact else (None, None)


def int4_codes(matrices) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """(group, each matrix's (values, scales)) at the first group size of INT4_GROUPS that holds
    every matrix exactly, or None: whether the int4 form represents a model's weights as they
    are. A matrix off the grid fails at once, so a model that is not int4 costs little."""
    matrices = list(matrices)
    for group in INT4_GROUPS:
        codes = []
        for w in matrices:
            q, scale = _exact_int4(w, group)
            if q is None:
                break
            codes.append((q, scale))
        else:
            if matrices:
                return group, codes
    return None


def matrix(
    form: str,
    w: torch.Tensor,
    in_scale: torch.Tensor | None = None,
    group: int = 32,
    codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Fp32Matrix | Int8Matrix | Int4Matrix | ModelFp32Matrix:
    """w in `form` (one of FORMS, or MODEL_FP32); `group` and `codes` (w's int4 values and scales,
    if known) for int4."""
    if form == MODEL_FP32:
        return ModelFp32Matrix(w, in_scale)
    if form not in FORMS:
        raise ValueError(f"lean decode weights are one of {FORMS}, not {form!r}")
    if form == "int4":
        return Int4Matrix(w, group, in_scale, codes)
    return Int8Matrix(w, in_scale) if form == "int8" else Fp32Matrix(w, in_scale)


@functools.cache
def int4_available() -> bool:
    """Whether this torch has the CPU int4 group product (a private op)."""
    try:
        w = torch.ones(16, 32, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 2)
        torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.ones(1, 32, dtype=torch.bfloat16),
            packed,
            32,
            torch.ones(1, 16, 2, dtype=torch.bfloat16),
        )
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache  # asked at every model's construction; the answer cannot change in a process
def int8_available() -> bool:
    """Whether this torch has the int8 weight-only product (it is a private op)."""
    try:
        torch._weight_int8pack_mm(
            torch.ones(1, 8, dtype=torch.bfloat16),
            torch.ones(8, 8, dtype=torch.int8),
            torch.ones(8, dtype=torch.bfloat16),
        )
        return True
    except (AttributeError, RuntimeError):
        return False
