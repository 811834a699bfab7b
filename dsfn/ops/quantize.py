"""Block-wise symmetric quantization for the wire (ZeRO++ qwZ): `quantize_blockwise` and
`dequantize_blockwise`, a Triton kernel each beside its plain-torch reference.

Layout: a flat tensor x of n elements is cut into blocks of `block` consecutive elements
(the last one may be shorter). Each block b gets one fp32 scale s_b and n codes, one byte
each (returned as uint8: every wire format travels as bytes):

- "int8": s_b = absmax_b / 127; code = clamp(floor(x / s_b + 0.5), -127, 127) as int8
  (round half up: the same op sequence in the kernel and the reference, so they agree
  bitwise); |x - code * s_b| <= s_b / 2.
- "int4" (qgZ's gradients): s_b = absmax_b / 7; codes -7..7 (round half up, clamped) stored
  as 1..15, two per byte (low nibble first; `numel` tells the dequantizer the count); an
  even block size. |x - code * s_b| <= s_b / 2.
- "fp8_e4m3": s_b = absmax_b / 448 (the format's largest finite value); code = (x / s_b)
  cast to float8_e4m3fn (round to nearest even); relative error <= 2^-4 of |x| above the
  format's subnormals. The kernel is int8's with the cast in place of the rounding.

Edge rules, the same in both paths: an all-zero block has s_b = 0 and codes 0, and
dequantizes to exact zeros; a block holding a NaN or an infinity has a non-finite scale,
codes 0, and dequantizes to NaN throughout (a diverged weight stays visibly non-finite,
never silently finite). Dequantizing computes code * s_b in fp32 (saturated at fp32's
largest finite value, which it can pass by an ulp for a block holding it), then casts to the
requested dtype (round to nearest even).

`quantize_blockwise(x, block, fmt) -> (codes uint8 [n] (int4: [ceil(n / 2)]), scales float32
[ceil(n / block)])`; `dequantize_blockwise(codes, scales, block, fmt, dtype, out=None,
numel=None) -> [n] of dtype`.
Inputs: float32, bfloat16 or float16, any shape (flattened; contiguous copies made where
needed). The Triton kernels run where `dsfn.ops.dispatch.use_triton` says (CUDA; CPU under
TRITON_INTERPRET=1, as the tests run them).
"""
from __future__ import annotations

import math

import torch

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import dispatch

__all__ = ["FORMATS", "check_format", "dequantize_blockwise", "dequantize_blockwise_torch", "quantize_blockwise",
           "quantize_blockwise_torch"]

FORMATS = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": 7.0}      # format -> its largest code magnitude
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32_MAX = torch.finfo(torch.float32).max     # code x scale may round one ulp past it: saturated


def check_format(fmt: str, block: int, where: str = "quantize_blockwise") -> None:
    """ConfigError for an unknown format or a block size that is not a positive integer (an
    even one for int4, whose codes pack two to a byte)."""
    if fmt not in FORMATS:
        raise ConfigError(f"{where}: format {fmt!r} is not one of {sorted(FORMATS)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ConfigError(f"{where}: block size {block!r} must be a positive integer (elements per scale)")
    if fmt == "int4" and block % 2:
        raise ConfigError(f"{where}: int4 packs two codes per byte; its block size {block} must be even")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        raise LeafTypeError(f"quantize_blockwise: a float32, bfloat16 or float16 tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}; integer and fp8 tensors have no "
                            "quantized wire format")


def quantize_blockwise_torch(x: torch.Tensor, block: int, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (module docstring)."""
    check_format(fmt, block)
    _check_input(x)
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = math.ceil(n / block)
    padded = torch.nn.functional.pad(flat, (0, nb * block - n)).view(nb, block)
    absmax = padded.abs().amax(1)
    # NaN anywhere in the block: amax propagates it (torch's amax does), so the scale is NaN
    absmax = torch.where(torch.isnan(padded).any(1), torch.full_like(absmax, math.nan), absmax)
    scale = absmax / FORMATS[fmt]
    ok = torch.isfinite(scale) & (scale > 0)
    safe = torch.where(ok, scale, torch.ones_like(scale))[:, None]
    q = padded / safe
    if fmt == "int4":        # codes -7..7 stored as 1..15, two per byte (low nibble first)
        codes = torch.clamp(torch.floor(q + 0.5), -7, 7)
        nib = (torch.where(ok[:, None], codes, torch.zeros_like(codes)) + 8).to(torch.uint8).reshape(-1)[:n]
        nib = torch.nn.functional.pad(nib, (0, n % 2), value=8)
        return (nib[0::2] | (nib[1::2] << 4)).contiguous(), scale.contiguous()
    if fmt == "int8":
        codes = torch.clamp(torch.floor(q + 0.5), -127, 127)
        codes = torch.where(ok[:, None], codes, torch.zeros_like(codes)).to(torch.int8).view(torch.uint8)
    else:
        codes = torch.where(ok[:, None], q, torch.zeros_like(q)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(-1)[:n].contiguous(), scale.contiguous()


def dequantize_blockwise_torch(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str = "int8",
                               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                               numel: int | None = None) -> torch.Tensor:
    """The reference (module docstring)."""
    check_format(fmt, block)
    if fmt == "int4":
        if numel is None:
            raise ShapeError("dequantize_blockwise(fmt='int4'): pass numel= (two codes per byte)")
        packed = codes.reshape(-1)
        codes = torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:numel]
    n = codes.numel()
    _check_codes(codes, scales, block, n, out, dtype)
    nb = scales.numel()
    padded = torch.nn.functional.pad(codes.reshape(-1), (0, nb * block - n)).view(nb, block)
    values = ((padded.to(torch.int16) - 8).float() if fmt == "int4" else padded.view(torch.int8).float()
              if fmt == "int8" else padded.view(torch.float8_e4m3fn).float())
    s = scales.float()[:, None]
    x = torch.where(torch.isfinite(s), (values * s).clamp(-_F32_MAX, _F32_MAX), torch.full_like(values, math.nan))
    x = x.reshape(-1)[:n].to(dtype)
    if out is None:
        return x
    return out.reshape(-1).copy_(x).view(out.shape)


def _check_codes(codes, scales, block, n, out, dtype) -> None:
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32 or scales.numel() != math.ceil(n / block):
        raise ShapeError(f"dequantize_blockwise: codes must be uint8 and scales float32 with ceil(n / block) = "
                         f"{math.ceil(n / block)} elements; got codes {codes.dtype} [{n}], scales {scales.dtype} "
                         f"[{scales.numel()}]")
    if dtype not in _DTYPES:
        raise LeafTypeError(f"dequantize_blockwise(dtype={dtype}): float32, bfloat16 or float16")
    if out is not None and (out.numel() != n or out.dtype != dtype or not out.is_contiguous()):
        raise ShapeError(f"dequantize_blockwise: out must be a contiguous {dtype} tensor of {n} elements")


def quantize_blockwise(x: torch.Tensor, block: int, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; on the Triton kernels where dispatch picks Triton (fp8: on
    GPUs with e4m3 conversions, compute capability 8.9+, and the interpreter)."""
    check_format(fmt, block)
    _check_input(x)
    if x.numel() == 0 or not dispatch.use_triton(x) or (fmt == "fp8_e4m3" and not _fp8_kernels(x.device)):
        return quantize_blockwise_torch(x, block, fmt)
    flat = x.detach().reshape(-1).contiguous()
    n = flat.numel()
    nb = math.ceil(n / block)
    src = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    with dispatch.device_guard(x):
        if fmt != "int4":
            codes = torch.empty(n, dtype=torch.uint8, device=x.device)
            _quantize_int8_kernel[(nb,)](src, codes, scales, n, BLOCK=block, PAD=triton.next_power_of_2(block),
                                         BF16=flat.dtype == torch.bfloat16, FP8=fmt == "fp8_e4m3")
        else:
            codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
            _quantize_int4_kernel[(nb,)](src, codes, scales, n, BLOCK=block, HALF=triton.next_power_of_2(block // 2),
                                         BF16=flat.dtype == torch.bfloat16)
    return codes, scales


def _fp8_kernels(device: torch.device) -> bool:
    """Whether Triton converts to and from float8 e4m3 on `device`: CUDA from compute
    capability 8.9 (Ada, Hopper), and the interpreter on the CPU."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str = "int8",
                         dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                         numel: int | None = None) -> torch.Tensor:
    """See the module docstring; on the Triton kernels where dispatch picks Triton (as
    `quantize_blockwise`). `numel`: the element count of int4 codes (two per byte), required there."""
    check_format(fmt, block)
    n = codes.numel() if fmt != "int4" else numel
    if not n or not dispatch.use_triton(codes, scales, *(() if out is None else (out,)), dtypes=(dtype,)) \
            or (fmt == "fp8_e4m3" and not _fp8_kernels(codes.device)):
        return dequantize_blockwise_torch(codes, scales, block, fmt, dtype, out, numel)
    _check_codes(codes if fmt != "int4" else torch.empty(n, dtype=torch.uint8, device="meta"), scales, block, n,
                 out, dtype)
    dst = out.reshape(-1) if out is not None else torch.empty(n, dtype=dtype, device=codes.device)
    from dsfn.ops.multi_tensor import TL_DTYPES
    with dispatch.device_guard(codes):
        if fmt != "int4":
            _dequantize_int8_kernel[(scales.numel(),)](codes.contiguous(), scales, dst, n, BLOCK=block,
                                                       PAD=triton.next_power_of_2(block), D_DTYPE=TL_DTYPES[dtype],
                                                       FP8=fmt == "fp8_e4m3")
        else:
            _dequantize_int4_kernel[(scales.numel(),)](codes.contiguous(), scales, dst, n, BLOCK=block,
                                                       HALF=triton.next_power_of_2(block // 2),
                                                       D_DTYPE=TL_DTYPES[dtype])
    return dst if out is None else out


try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a dependency on linux x86_64 only
    triton = None

if triton is not None:
    from dsfn.ops.adamw import cast_rne

    @triton.jit
    def _e4m3_bits(q):
        """fp32 values of magnitude <= 448 -> their float8 e4m3fn codes (uint8), round to
        nearest even, by integer arithmetic on the fp32 bits: the same on every backend
        (a hardware or interpreter cast may round through fp16 first: a double rounding)."""
        bits = q.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        a = bits & 0x7FFFFFFF
        # normal range (>= 2^-6): keep 3 of the 23 mantissa bits, ties to even, then rebias 127 -> 7
        r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
        normal = r.to(tl.int32) - (120 << 3)
        # subnormals (steps of 2^-9): |q| * 512 rounded to the nearest integer, ties to even
        y = tl.abs(q) * 512.0
        k = tl.floor(y + 0.5)
        k = tl.where((k - y == 0.5) & ((k.to(tl.int32) & 1) == 1), k - 1.0, k)
        mag = tl.where(a < 0x3C800000, k.to(tl.int32), normal)       # 0x3C800000: 2^-6
        return (mag | sign.to(tl.int32)).to(tl.uint8)

    @triton.jit
    def _e4m3_value(c):
        """float8 e4m3fn codes (uint8) -> their fp32 values, exactly (0x7F / 0xFF: NaN)."""
        c = c.to(tl.uint32)
        e = (c >> 3) & 15
        m = c & 7
        normal = ((c >> 7) << 31 | (e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125
        sub = tl.where((c >> 7) == 1, -sub, sub)
        v = tl.where(e == 0, sub, normal)
        return tl.where((e == 15) & (m == 7), float("nan"), v)

    @triton.jit
    def _quantize_int8_kernel(src, codes, scales, n, BLOCK: tl.constexpr, PAD: tl.constexpr, BF16: tl.constexpr,
                              FP8: tl.constexpr = False):
        """One program: one block of BLOCK elements (the last may be short); `FP8`: the
        codes are x / scale cast to float8 e4m3 (round to nearest even) instead of int8."""
        b = tl.program_id(0).to(tl.int64)
        offs = b * BLOCK + tl.arange(0, PAD).to(tl.int64)
        mask = (tl.arange(0, PAD) < BLOCK) & (offs < n)
        if BF16:      # read as bits and widened by a shift: exact on every backend
            bits = tl.load(src + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        has_nan = tl.max((x != x).to(tl.int32), axis=0)
        absmax = tl.max(tl.abs(x), axis=0)
        absmax = tl.where(has_nan > 0, float("nan"), absmax)
        if FP8:
            scale = absmax / 448.0
        else:
            scale = absmax / 127.0
        ok = (scale == scale) & (scale < float("inf")) & (scale > 0)
        safe = tl.where(ok, scale, 1.0)
        if FP8:
            q = tl.where(ok, x / safe, 0.0)
            tl.store(codes + offs, _e4m3_bits(q), mask=mask)
        else:
            q = tl.floor(x / safe + 0.5)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            q = tl.where(ok, q, 0.0)
            tl.store(codes + offs, q.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
        tl.store(scales + b, scale)

    @triton.jit
    def _dequantize_int8_kernel(codes, scales, dst, n, BLOCK: tl.constexpr, PAD: tl.constexpr,
                                D_DTYPE: tl.constexpr, FP8: tl.constexpr = False):
        b = tl.program_id(0).to(tl.int64)
        offs = b * BLOCK + tl.arange(0, PAD).to(tl.int64)
        mask = (tl.arange(0, PAD) < BLOCK) & (offs < n)
        if FP8:
            c = _e4m3_value(tl.load(codes + offs, mask=mask, other=0))
        else:
            c = tl.load(codes + offs, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s = tl.load(scales + b)
        finite = (s == s) & (tl.abs(s) < float("inf"))
        x = tl.where(finite, tl.minimum(tl.maximum(c * s, -3.4028234663852886e38), 3.4028234663852886e38),
                     float("nan"))
        tl.store(dst + offs, cast_rne(x, D_DTYPE), mask=mask)

    @triton.jit
    def _quantize_int4_kernel(src, codes, scales, n, BLOCK: tl.constexpr, HALF: tl.constexpr, BF16: tl.constexpr):
        """One program: one block; element pairs (2i, 2i + 1) of the block make byte i (low nibble first)."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HALF)
        even = b * BLOCK + 2 * i.to(tl.int64)
        m_even = (i < BLOCK // 2) & (even < n)
        m_odd = (i < BLOCK // 2) & (even + 1 < n)
        if BF16:
            lo = (tl.load(src + even, mask=m_even, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True)
            hi = (tl.load(src + even + 1, mask=m_odd, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True)
        else:
            lo = tl.load(src + even, mask=m_even, other=0.0).to(tl.float32)
            hi = tl.load(src + even + 1, mask=m_odd, other=0.0).to(tl.float32)
        has_nan = tl.maximum(tl.max((lo != lo).to(tl.int32), axis=0), tl.max((hi != hi).to(tl.int32), axis=0))
        absmax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
        absmax = tl.where(has_nan > 0, float("nan"), absmax)
        scale = absmax / 7.0
        ok = (scale == scale) & (scale < float("inf")) & (scale > 0)
        safe = tl.where(ok, scale, 1.0)
        q_lo = tl.where(ok, tl.minimum(tl.maximum(tl.floor(lo / safe + 0.5), -7.0), 7.0), 0.0)
        q_hi = tl.where(ok, tl.minimum(tl.maximum(tl.floor(hi / safe + 0.5), -7.0), 7.0), 0.0)
        # an element past n pads its byte's high nibble with code 0 (stored 8), as the reference does
        q_hi = tl.where(m_odd, q_hi, 0.0)
        byte = (q_lo.to(tl.int32) + 8) | ((q_hi.to(tl.int32) + 8) << 4)
        tl.store(codes + b * (BLOCK // 2) + i.to(tl.int64), byte.to(tl.uint8), mask=m_even)
        tl.store(scales + b, scale)

    @triton.jit
    def _dequantize_int4_kernel(codes, scales, dst, n, BLOCK: tl.constexpr, HALF: tl.constexpr,
                                D_DTYPE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HALF)
        even = b * BLOCK + 2 * i.to(tl.int64)
        m_even = (i < BLOCK // 2) & (even < n)
        m_odd = (i < BLOCK // 2) & (even + 1 < n)
        byte = tl.load(codes + b * (BLOCK // 2) + i.to(tl.int64), mask=m_even, other=136).to(tl.int32)
        lo = ((byte & 15) - 8).to(tl.float32)
        hi = ((byte >> 4) - 8).to(tl.float32)
        s = tl.load(scales + b)
        finite = (s == s) & (tl.abs(s) < float("inf"))
        big = 3.4028234663852886e38
        x_lo = tl.where(finite, tl.minimum(tl.maximum(lo * s, -big), big), float("nan"))
        x_hi = tl.where(finite, tl.minimum(tl.maximum(hi * s, -big), big), float("nan"))
        tl.store(dst + even, cast_rne(x_lo, D_DTYPE), mask=m_even)
        tl.store(dst + even + 1, cast_rne(x_hi, D_DTYPE), mask=m_odd)
