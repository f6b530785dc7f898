"""The Python half of the block-scaled quantizers' parity check (block_scaled_parity.cc).

    block_scaled_twin.py OUT_DIR

torchao and Transformer Engine are not installed: their functions are written
out below from their sources, each citing its file and function, and run on
the inputs the C++ half wrote (OUT/inputs.pt). Every result is compared with
amp's bit for bit (codes and scale bytes, dequantized values as integers).
Exits 1 on any difference.

Sources (snapshots read for this file):
  torchao  torchao/prototype/mx_formats/mx_tensor.py, constants.py, kernels.py,
           nvfp4_tensor.py; torchao/prototype/custom_fp_utils.py
           (pytorch/ao 36027d82d1ad9949597ea16002ff4940374b1b94);
           mx_formats/utils.py: to_blocked
           (pytorch/ao 047c25c4bd98ad45cafd8e637bf1ffc9fdc0c432)
  TE       transformer_engine/pytorch/custom_recipes/reference_nvfp4.py
           (NVIDIA/TransformerEngine d0067d0da6cb01811b8072a7d304f0e00344ce2b)
MXFP8 follows torchao (to_mx, to_dtype, and MXFP8Linear's emulated GEMMs,
trained in fp32); NVFP4's quantization follows TE's NVFP4QuantizerRef, its
dequantization torchao's NVFP4Tensor.dequantize.
"""
import sys

import torch

import torch.nn.functional as F

from parity_io import init, make_mlp

# --- torchao: constants.py ---------------------------------------------------
F8E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
F8E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344.0
F8E4M3_MAX_POW2 = 8
F8E5M2_MAX_POW2 = 15
E8M0_EXPONENT_BIAS = 127
E8M0_EXPONENT_NAN_VAL = 255
F32_EXP_BIAS = 127
F4_E2M1_MAX = 6.0

# --- torchao: mx_tensor.py ---------------------------------------------------
SBITS, EBITS_F32, MBITS_F32 = 1, 8, 23
EBITS_F8_E4M3, MBITS_F8_E4M3 = 4, 3
EBITS_F8_E5M2, MBITS_F8_E5M2 = 5, 2


def _version_at_least(major, minor):  # torchao/utils.py: torch_version_at_least("X.Y.0.dev0")
    v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return v >= (major, minor)


_TORCH_VERSION_AT_LEAST_2_13 = _version_at_least(2, 13)
_TORCH_VERSION_AT_LEAST_2_14 = _version_at_least(2, 14)
HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")


def _f32_to_e8m0_rceil(value):  # mx_tensor.py: _f32_to_e8m0_rceil
    value = value.to(torch.float32)
    value_bits = value.view(torch.int32)
    biased_exponent = torch.bitwise_right_shift(value_bits, MBITS_F32) & 0xFF
    mantissa = value_bits & 0x7FFFFF
    needs_round_up = torch.where(biased_exponent == 0, mantissa > 0x400000, mantissa != 0)
    e8m0_biased = biased_exponent + needs_round_up.to(torch.int32)
    return torch.where(torch.isfinite(value), e8m0_biased, E8M0_EXPONENT_NAN_VAL).to(torch.uint8)


def _e8m0_scale_to_reciprocal_fp32(scale_e8m0_biased):  # mx_tensor.py
    reciprocal_e8m0_biased = (2 * E8M0_EXPONENT_BIAS - scale_e8m0_biased.to(torch.int32)).to(torch.uint8)
    if _TORCH_VERSION_AT_LEAST_2_14:
        return reciprocal_e8m0_biased.view(torch.float8_e8m0fnu).to(torch.float32)
    reciprocal_fp32_bits = torch.bitwise_left_shift(reciprocal_e8m0_biased.to(torch.int32), MBITS_F32)
    reciprocal_fp32_bits = torch.where(reciprocal_e8m0_biased == 0, 0x00400000, reciprocal_fp32_bits)
    reciprocal_fp32_bits = torch.where(reciprocal_e8m0_biased == E8M0_EXPONENT_NAN_VAL, 0x7F800001,
                                       reciprocal_fp32_bits)
    return reciprocal_fp32_bits.view(torch.float32)


def _to_mx_rceil(data_hp, max_abs, max_pos):  # mx_tensor.py: eager (not compiling) branch
    descale = max_abs * (1.0 / max_pos)
    exponent = _f32_to_e8m0_rceil(descale)
    rcp_fp32 = _e8m0_scale_to_reciprocal_fp32(exponent)
    data_lp = data_hp * rcp_fp32
    return exponent, data_lp


def to_mx(data_hp, elem_dtype, block_size, scaling_mode):  # mx_tensor.py: to_mx, float8 elements
    assert data_hp.dtype in (torch.bfloat16, torch.float)
    assert data_hp.shape[-1] % block_size == 0
    assert data_hp.is_contiguous()
    orig_shape = data_hp.shape
    data_hp = data_hp.reshape(*orig_shape[:-1], orig_shape[-1] // block_size, block_size)
    max_abs = torch.amax(torch.abs(data_hp), -1).unsqueeze(-1)
    data_hp = data_hp.to(torch.float32)
    max_abs = max_abs.to(torch.float32)
    if elem_dtype == torch.float8_e4m3fn:
        target_max_pow2, mbits, max_pos = F8E4M3_MAX_POW2, MBITS_F8_E4M3, F8E4M3_MAX
    elif elem_dtype == torch.float8_e5m2:
        target_max_pow2, mbits, max_pos = F8E5M2_MAX_POW2, MBITS_F8_E5M2, F8E5M2_MAX
    else:
        raise AssertionError("unsupported element dtype")

    if scaling_mode == "rceil":
        scale_e8m0_biased, data_lp = _to_mx_rceil(data_hp, max_abs, max_pos)
    else:
        hp_int_dtype, hp_mbits, hp_ebits, hp_exp_bias = torch.int32, MBITS_F32, EBITS_F32, F32_EXP_BIAS
        if scaling_mode == "even":
            nan_mask = torch.isnan(max_abs)
            max_abs = max_abs.view(hp_int_dtype)
            val_to_add = 1 << (hp_mbits - mbits - 1)
            mask = ((1 << (hp_ebits + SBITS)) - 1) << hp_mbits
            max_abs = (max_abs + val_to_add) & mask
            max_abs = max_abs.view(data_hp.dtype)
            max_abs[nan_mask] = torch.tensor(float("nan"), device=max_abs.device, dtype=max_abs.dtype)
        max_abs_int32 = max_abs.view(hp_int_dtype)
        extracted_pow2 = ((torch.bitwise_right_shift(max_abs_int32, hp_mbits)) & 0b11111111) - hp_exp_bias
        if scaling_mode in ("floor", "even"):
            scale_e8m0_unbiased = extracted_pow2 - target_max_pow2
        elif scaling_mode == "ceil":
            mantissa_gt_one = (max_abs_int32 & 0x7FFFFF) > 0
            extracted_pow2 += mantissa_gt_one
            scale_e8m0_unbiased = extracted_pow2 - target_max_pow2
        else:
            raise AssertionError("unsupported scaling calculation mode")
        scale_e8m0_unbiased = torch.clamp(scale_e8m0_unbiased, min=-E8M0_EXPONENT_BIAS, max=E8M0_EXPONENT_BIAS + 1)
        scale_e8m0_biased = scale_e8m0_unbiased + E8M0_EXPONENT_BIAS
        scale_e8m0_biased = scale_e8m0_biased.to(torch.uint8)
        scale_e8m0_biased = torch.where(torch.isfinite(max_abs), scale_e8m0_biased, E8M0_EXPONENT_NAN_VAL)
        inv_scale = _e8m0_scale_to_reciprocal_fp32(scale_e8m0_biased)
        data_lp = data_hp * inv_scale
        needs_eager_saturation = elem_dtype == torch.float8_e5m2 or (
            elem_dtype == torch.float8_e4m3fn and not _TORCH_VERSION_AT_LEAST_2_13)
        if needs_eager_saturation:
            data_lp = torch.clamp(data_lp, min=-1 * max_pos, max=max_pos)

    data_lp = data_lp.to(elem_dtype)
    data_lp = data_lp.reshape(orig_shape)
    if HAS_E8M0:
        scale_e8m0_biased = scale_e8m0_biased.view(torch.float8_e8m0fnu)
    scale_e8m0_biased = scale_e8m0_biased.squeeze(-1)
    return scale_e8m0_biased, data_lp


def get_fp_scale(scale_e8m0):  # mx_tensor.py
    scale_e8m0 = scale_e8m0.view(torch.uint8)
    s_offset = scale_e8m0.to(torch.int16) - E8M0_EXPONENT_BIAS
    two = torch.full_like(s_offset, 2.0, dtype=torch.float32)
    s_fp = torch.pow(two, s_offset)
    s_fp = torch.where(scale_e8m0 != E8M0_EXPONENT_NAN_VAL, s_fp, float("nan"))
    return s_fp


def to_dtype(data_lp, scale_e8m0, elem_dtype, block_size, target_dtype):  # mx_tensor.py, float8 elements
    orig_shape = data_lp.shape
    data_hp = data_lp.to(target_dtype)
    data_hp = data_hp.reshape(-1, block_size)
    s_fp = get_fp_scale(scale_e8m0).reshape(-1, 1).to(target_dtype)
    data_hp = data_hp * s_fp
    return data_hp.reshape(orig_shape)


# --- torchao: kernels.py, custom_fp_utils.py, nvfp4_tensor.py ---------------
def unpack_uint4(uint8_data):  # kernels.py
    shape = uint8_data.shape
    first_elements = (uint8_data & 0b1111).to(torch.uint8)
    second_elements = (uint8_data >> 4).to(torch.uint8)
    return torch.stack([first_elements, second_elements], dim=-1).view(*shape[:-1], shape[-1] * 2)


def f4_unpacked_to_f32(x, ebits=2, mbits=1):  # custom_fp_utils.py: _floatx_unpacked_to_f32, mbits == 1
    sign_mask = 1 << (ebits + mbits)
    exp_bias = (1 << (ebits - 1)) - 1
    mantissa_mask = (1 << mbits) - 1
    sign_lp = x & sign_mask
    x_pos = x ^ sign_lp
    zero_mask = x_pos == 0
    denormal_mask = torch.logical_and((x_pos > 0), ((x_pos >> mbits) == 0))
    exp_biased_lp = x_pos >> mbits
    exp_biased_f32 = exp_biased_lp - exp_bias + F32_EXP_BIAS
    exp_biased_f32 = exp_biased_f32.to(torch.int32) << MBITS_F32
    mantissa_lp_int32 = (x_pos & mantissa_mask).to(torch.int32)
    mantissa_f32 = mantissa_lp_int32 << (MBITS_F32 - mbits)
    result = exp_biased_f32 | mantissa_f32
    result[zero_mask] = 0
    denormal_exp_biased = 1 - exp_bias + F32_EXP_BIAS
    result[denormal_mask] = (denormal_exp_biased - mbits) << MBITS_F32
    sign_f32 = sign_lp.to(torch.int32) << (MBITS_F32 - mbits + EBITS_F32 - ebits)
    result = result | sign_f32
    return result.view(torch.float)


def per_tensor_amax_to_scale(amax):  # nvfp4_tensor.py
    return amax.to(torch.float32) / (F8E4M3_MAX * F4_E2M1_MAX)


def nvfp4_dequantize(qdata, scale, per_tensor_scale, block_size=16):  # nvfp4_tensor.py: NVFP4Tensor.dequantize
    M, K = qdata.shape[0], qdata.shape[1] * 2
    data_unpacked = unpack_uint4(qdata.contiguous().view(torch.uint8))
    data_f32 = f4_unpacked_to_f32(data_unpacked)
    data_f32 = data_f32.view(M, K // block_size, block_size)
    hp_scales = per_tensor_scale * scale.to(torch.float)  # get_hp_scales
    scale_e4m3_reshaped = hp_scales.view(M, K // block_size, 1)
    data_scaled = data_f32 * scale_e4m3_reshaped.to(torch.float32)
    return data_scaled.view(M, K).to(torch.float32)


# --- Transformer Engine: custom_recipes/reference_nvfp4.py --------------------
def cast_to_fp4x2(x):
    result = torch.zeros_like(x, dtype=torch.uint8)
    result[(x >= 0.0) & (x <= 0.25)] = 0
    result[(x > 0.25) & (x < 0.75)] = 1
    result[(x >= 0.75) & (x <= 1.25)] = 2
    result[(x > 1.25) & (x < 1.75)] = 3
    result[(x >= 1.75) & (x <= 2.5)] = 4
    result[(x > 2.5) & (x < 3.5)] = 5
    result[(x >= 3.5) & (x <= 5.0)] = 6
    result[x > 5.0] = 7
    result[(x >= -0.25) & (x < -0.0)] = 8
    result[(x < -0.25) & (x > -0.75)] = 9
    result[(x <= -0.75) & (x >= -1.25)] = 10
    result[(x < -1.25) & (x > -1.75)] = 11
    result[(x <= -1.75) & (x >= -2.5)] = 12
    result[(x < -2.5) & (x > -3.5)] = 13
    result[(x <= -3.5) & (x >= -5.0)] = 14
    result[x < -5.0] = 15
    return result[:, ::2] + result[:, 1::2] * 16


def get_wgrad_sign_vector():
    return torch.tensor(
        [1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0],
        dtype=torch.float32,
    )


def _build_hadamard_matrix(size, device, dtype, with_random_sign_mask=True):  # NVFP4QuantizerRef
    h = torch.ones((1, 1), device=device, dtype=torch.float32)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    if with_random_sign_mask:
        sign_mat = get_wgrad_sign_vector().to(device) * torch.eye(size, device=device, dtype=torch.float32)
        h = sign_mat @ h
    return h.to(dtype)


def _apply_rht(x, rht_dim=16):  # NVFP4QuantizerRef._apply_rht (with_rht=True)
    H = _build_hadamard_matrix(rht_dim, x.device, x.dtype, True)
    scale = 1.0 / float(rht_dim) ** 0.5
    original_shape = x.shape
    x_mat = x.contiguous().view(-1, rht_dim)
    transform = H * scale
    out = x_mat @ transform
    return out.view(original_shape)


def _pad_tensor(tensor, row_divisor, col_divisor):  # NVFP4QuantizerRef._pad_tensor
    M, N = tensor.shape
    rows = row_divisor - (M % row_divisor) if M % row_divisor != 0 else 0
    cols = col_divisor - (N % col_divisor) if N % col_divisor != 0 else 0
    if rows == 0 and cols == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, cols, 0, rows), mode="constant", value=0.0).contiguous()


def _quantize_blockwise_reference(x, global_amax, tile_len_x, tile_len_y):
    """NVFP4QuantizerRef._quantize_blockwise_reference: pow_2_scales=False,
    row_scaled_nvfp4=False, nvfp4_use_4over6=False."""
    using_2d_quantization = tile_len_x == 16 and tile_len_y == 16
    m, n = x.shape
    if using_2d_quantization:
        x_blocks = x.unfold(0, tile_len_y, tile_len_y).unfold(1, tile_len_x, tile_len_x).to(torch.float32)
        block_amax = torch.amax(torch.abs(x_blocks), dim=(-1, -2))
        vec_max = block_amax.repeat_interleave(tile_len_y, dim=0).unsqueeze(-1)
    else:
        x_reshaped = x.view(m, n // tile_len_x, tile_len_x)
        vec_max = torch.amax(torch.abs(x_reshaped), dim=-1, keepdim=True).to(torch.float32)
    x = x.view(m, n // tile_len_x, tile_len_x)
    FLOAT4_E2M1_MAX = torch.tensor(6.0, device=x.device, dtype=torch.float32)
    FLOAT8_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)
    GLOBAL_SCALE_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)
    decode_scale = torch.div(vec_max, FLOAT4_E2M1_MAX)
    global_encode_scale = torch.div(GLOBAL_SCALE_E4M3_MAX * FLOAT4_E2M1_MAX, global_amax)
    global_encode_scale = torch.min(
        global_encode_scale, torch.tensor(torch.finfo(torch.float32).max, device=x.device, dtype=torch.float32))
    if global_encode_scale.numel() == 1:
        if global_encode_scale == torch.tensor(0.0, device=x.device, dtype=torch.float32):
            global_encode_scale = torch.tensor(1.0, device=x.device, dtype=torch.float32)
    global_decode_scale = torch.div(1.0, global_encode_scale)
    global_encode_scale_multiplier = global_encode_scale * torch.reciprocal(FLOAT4_E2M1_MAX)
    decode_scale = vec_max * global_encode_scale_multiplier
    decode_scale = torch.min(
        decode_scale, torch.tensor(torch.finfo(torch.float32).max, device=x.device, dtype=torch.float32))
    decode_scale = torch.clamp(decode_scale, min=-FLOAT8_E4M3_MAX, max=FLOAT8_E4M3_MAX)
    decode_scale = decode_scale.to(torch.float8_e4m3fn)
    encode_scale = torch.min(
        torch.div(1.0, decode_scale.to(torch.float32) * global_decode_scale),
        torch.tensor(torch.finfo(torch.float32).max, device=x.device, dtype=torch.float32))
    scaled_x = x.to(torch.float32) * encode_scale
    clipped_x = torch.clamp(scaled_x, -FLOAT4_E2M1_MAX, FLOAT4_E2M1_MAX).reshape(m, n)
    return cast_to_fp4x2(clipped_x), decode_scale.squeeze(-1)


def nvfp4_quantize_rowwise(tensor, tile_shape):
    """NVFP4QuantizerRef._quantize's rowwise half (row_input = tensor): the
    global amax, the padded tensor's blocks, the padding rows of qx removed
    (TE keeps the padding rows' scales; amp drops them, so they are dropped
    here before comparing)."""
    global_amax_row = torch.max(torch.abs(tensor)).to(torch.float32).view(1)
    M, N = tensor.shape
    x_padded = _pad_tensor(tensor, row_divisor=tile_shape[0], col_divisor=tile_shape[1])
    qx, sx = _quantize_blockwise_reference(x_padded, global_amax_row, tile_shape[1], tile_shape[0])
    qx = qx[:M, :N // 2].contiguous()
    return qx, sx[:M], global_amax_row


def nvfp4_quantize_columnwise_rht(tensor):
    """NVFP4QuantizerRef._quantize's columnwise half with with_rht=True and
    1x16 tiles: col_input = _apply_rht(tensor.t().contiguous()), its own amax."""
    col_input = _apply_rht(tensor.t().contiguous())
    return nvfp4_quantize_rowwise(col_input, (1, 16))


# --- torchao: mx_formats/utils.py ---------------------------------------------
def ceil_div(a, b):  # utils.py
    return (a + b - 1) // b


def to_blocked(input_matrix):  # utils.py: to_blocked, eager (use_triton_kernel=False, not compiling)
    rows, cols = input_matrix.shape
    n_row_blocks = ceil_div(rows, 128)
    n_col_blocks = ceil_div(cols, 4)
    padded_rows = n_row_blocks * 128
    padded_cols = n_col_blocks * 4
    padded = input_matrix
    if (rows, cols) != (padded_rows, padded_cols):
        padded = torch.zeros((padded_rows, padded_cols), device=input_matrix.device, dtype=input_matrix.dtype)
        padded[:rows, :cols] = input_matrix
    blocks = padded.view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3)
    rearranged = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return rearranged.flatten()


# --- torchao: MXFP8Linear with KernelPreference.EMULATED ----------------------
def mx_mm_emulated(a, b):
    """mx_tensor.py: _addmm_mx_dispatch's EMULATED branch for torch.mm(a, b) of two
    MXTensors given as (scale, data, orig_dtype): each dequantized to its
    orig_dtype (to_dtype; a transposed MXTensor, mx_t's, is dequantized
    transposed back and forth), then aten.mm. b is the MXTensor whose .t() is
    multiplied, i.e. quantized as [N, K]."""
    (sa, da, ta), (sb, db, tb) = a, b
    a_hp = to_dtype(da, sa, torch.float8_e4m3fn, 32, ta)
    b_hp = to_dtype(db, sb, torch.float8_e4m3fn, 32, tb).t()
    return torch.mm(a_hp, b_hp)


def mx_to(t, mode):  # MXTensor.to_mx with EMULATED: to_mx; orig_dtype = t.dtype
    scale, data = to_mx(t, torch.float8_e4m3fn, 32, mode)
    return scale, data, t.dtype


class mx_mm(torch.autograd.Function):
    """moe_training/mxfp8_linear.py: mx_mm (e4m3 everywhere, block 32,
    EMULATED); the dim1 casts are utils.py's _to_mxfp8_dim1_kernel_wrapper,
    whose EMULATED branch quantizes the transpose made contiguous."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, mode, wgrad_with_hp):
        ctx.save_for_backward(input_hp, weight_hp)
        ctx.mode, ctx.wgrad_with_hp = mode, wgrad_with_hp
        input_orig_shape = input_hp.shape
        input_hp_r = input_hp.reshape(-1, input_orig_shape[-1])
        output = mx_mm_emulated(mx_to(input_hp_r, mode), mx_to(weight_hp, mode))
        return output.reshape(*input_orig_shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output_hp):
        input_hp, weight_hp = ctx.saved_tensors
        mode = ctx.mode
        grad_output_hp = grad_output_hp.contiguous()
        grad_output_hp_r = grad_output_hp.reshape(-1, grad_output_hp.shape[-1])
        input_hp_r = input_hp.reshape(-1, input_hp.shape[-1])
        grad_output_mx_dim0 = mx_to(grad_output_hp_r, mode)
        weight_mx_dim1 = mx_to(weight_hp.t().contiguous(), mode)
        grad_input = mx_mm_emulated(grad_output_mx_dim0, weight_mx_dim1)
        grad_input = grad_input.reshape(*grad_output_hp.shape[:-1], grad_input.shape[-1])
        if ctx.wgrad_with_hp:
            grad_weight = torch.mm(grad_output_hp_r.t(), input_hp_r)
        else:
            grad_output_mx_dim1 = mx_to(grad_output_hp_r.t().contiguous(), mode)  # [N, M]
            input_t_mx_dim0_tmp = mx_to(input_hp_r.t().contiguous(), mode)  # [K, M], used as .t()
            grad_weight = mx_mm_emulated(grad_output_mx_dim1, input_t_mx_dim0_tmp)
        return grad_input, grad_weight, None, None


def mxfp8_linear(x, linear, mode, wgrad_with_hp):  # MXFP8Linear.forward
    output = mx_mm.apply(x, linear.weight, mode, wgrad_with_hp)
    if linear.bias is not None:
        output = output + linear.bias.to(output.dtype)
    return output


def train(mode, wgrad_with_hp, steps=30):
    """What block_scaled_parity.cc's train() runs: parity_io's MLP, fp32, SGD with momentum."""
    model = make_mlp()
    torch.manual_seed(1)
    x = torch.randn(steps, 32, 64) * 4
    y = torch.randint(0, 10, (steps, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    fc = [m for m in model if isinstance(m, torch.nn.Linear)]
    losses = []
    for i in range(steps):
        opt.zero_grad()
        h = torch.relu(mxfp8_linear(x[i], fc[0], mode, wgrad_with_hp))
        h = torch.relu(mxfp8_linear(h, fc[1], mode, wgrad_with_hp))
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, fc[2].weight, fc[2].bias), y[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses).view(torch.int32)] + [p.detach().view(torch.int32) for p in model.parameters()]


# --- a 2-block transformer trained under MXFP8 and NVFP4 ----------------------
def mxlinear_autocast(x, linear, mode):
    """mx_linear.py: MXLinear.forward under autocast: x and the weight cast to
    the autocast dtype (bf16), then mx_mm (EMULATED, wgrad in MXFP8). Where amp
    departs from MXLinear, so does this function, and says so: the bias is added
    in the output's dtype (torchao's Float8Linear's `output + bias.to(output.dtype)`;
    MXLinear's `y + self.bias` would promote the output to fp32)."""
    y = mx_mm.apply(x.to(torch.bfloat16), linear.weight.to(torch.bfloat16), mode, False)
    return y + linear.bias.to(y.dtype)


def nvfp4_emulated_mm(a, b):
    """a [M, K] . b [N, K]^T, each (qdata, scale, amax) dequantized with torchao's
    NVFP4Tensor.dequantize to fp32 and multiplied in fp32, below autocast (as a
    tensor subclass's __torch_dispatch__ runs it)."""
    with torch.autocast("cpu", enabled=False):
        a_hp = nvfp4_dequantize(a[0], a[1], per_tensor_amax_to_scale(a[2]))
        b_hp = nvfp4_dequantize(b[0], b[1], per_tensor_amax_to_scale(b[2]))
        return torch.mm(a_hp, b_hp.t())


class nvfp4_mm(torch.autograd.Function):
    """Transformer Engine's NVFP4BlockScaling recipe (recipe.py defaults without
    stochastic rounding: fp4_quant_fwd_inp 1x16, fp4_quant_fwd_weight 16x16 (2D),
    fp4_quant_bwd_grad 1x16 with the RHT on wgrad's operands), each operand
    quantized by NVFP4QuantizerRef as transcribed above: forward x (rowwise) .
    w (16x16); dgrad dy (rowwise) . w^T (16x16, TE's columnwise 2D copy);
    wgrad RHT(dy^T) . RHT(x^T) (TE's columnwise usage with with_rht)."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp):
        ctx.save_for_backward(input_hp, weight_hp)
        shape = input_hp.shape
        x = input_hp.reshape(-1, shape[-1])
        y = nvfp4_emulated_mm(nvfp4_quantize_rowwise(x, (1, 16)), nvfp4_quantize_rowwise(weight_hp, (16, 16)))
        return y.to(input_hp.dtype).reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp = ctx.saved_tensors
        dy = grad_output.contiguous().reshape(-1, grad_output.shape[-1])
        x = input_hp.reshape(-1, input_hp.shape[-1])
        dx = nvfp4_emulated_mm(nvfp4_quantize_rowwise(dy, (1, 16)),
                               nvfp4_quantize_rowwise(weight_hp.t().contiguous(), (16, 16)))
        dw = nvfp4_emulated_mm(nvfp4_quantize_columnwise_rht(dy), nvfp4_quantize_columnwise_rht(x))
        return dx.to(dy.dtype).reshape(*input_hp.shape[:-1], dx.shape[-1]), dw.to(weight_hp.dtype)


def nvfp4_linear_autocast(x, linear):
    """TE's Linear under autocast: input and weight in the autocast dtype (bf16),
    the bias added after the GEMM in that dtype."""
    y = nvfp4_mm.apply(x.to(torch.bfloat16), linear.weight.to(torch.bfloat16))
    return y + linear.bias.to(y.dtype)


class TwoBlocks(torch.nn.Module):
    """block_scaled_parity.cc's TwoBlocks, op for op; `lin(module, x)` runs the fitting linears."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(64)
            self.qkv = torch.nn.Linear(64, 192)
            self.proj = torch.nn.Linear(64, 64)
            self.ln2 = torch.nn.LayerNorm(64)
            self.fc1 = torch.nn.Linear(64, 256)
            self.fc2 = torch.nn.Linear(256, 64)

        def forward(self, x, lin):
            b, t = x.shape[0], x.shape[1]
            parts = lin(self.qkv, self.ln1(x)).reshape(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
            q, k, v = parts[0], parts[1], parts[2]
            att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / 4.0, -1)
            o = torch.matmul(att, v).permute(0, 2, 1, 3).reshape(b, t, 64)
            h = x + lin(self.proj, o)
            return h + lin(self.fc2, F.gelu(lin(self.fc1, self.ln2(h))))

    def __init__(self):
        super().__init__()
        self.b0 = TwoBlocks.Block()
        self.b1 = TwoBlocks.Block()
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x, lin):
        return self.head(self.b1(self.b0(x, lin), lin).mean(1))  # the head (10 outputs) fits neither: bf16


BLOCK_STEPS = 50


def train_blocks(recipe):
    """recipe: "rceil", "floor" (MXFP8) or "nvfp4"; SGD with momentum under bf16 autocast."""
    model = TwoBlocks()
    init(model)
    torch.manual_seed(1)
    x = torch.randn(BLOCK_STEPS, 4, 8, 64)
    y = torch.randint(0, 10, (BLOCK_STEPS, 4))
    if recipe == "nvfp4":
        lin = lambda m, t: nvfp4_linear_autocast(t, m)
    else:
        lin = lambda m, t: mxlinear_autocast(t, m, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses = []
    for i in range(BLOCK_STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[i], lin), y[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses).view(torch.int32)] + [p.detach().view(torch.int32) for p in model.parameters()]


# --- the comparison ------------------------------------------------------------
def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def main():
    out = sys.argv[1]
    inputs = torch.load(f"{out}/inputs.pt", weights_only=False)
    cpp_mx = torch.load(f"{out}/cpp_mx.pt", weights_only=False)
    cpp_nv = torch.load(f"{out}/cpp_nvfp4.pt", weights_only=False)
    edges, random = inputs[0], inputs[1]
    nv_cases, rht_in = inputs[2:-1], inputs[-1]
    failures = []
    compared = 0

    def check(name, ours, theirs):
        nonlocal compared
        compared += 1
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
            diff = (ours != theirs).sum().item() if ours.shape == theirs.shape else "shape"
            failures.append(f"{name}: {diff} differ")

    i = 0
    for xname, x in (("edges", edges), ("random", random)):
        for dtype in (torch.float32, torch.bfloat16):
            for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
                for mode in ("floor", "rceil", "ceil", "even"):
                    name = f"mx {xname} {str(dtype)[6:]} {str(elem)[6:]} {mode}"
                    scale, data = to_mx(x.to(dtype).contiguous(), elem, 32, mode)
                    check(name + " codes", cpp_mx[i], as_bytes(data))
                    check(name + " scales", cpp_mx[i + 1], as_bytes(scale))
                    check(name + " to fp32", cpp_mx[i + 2], to_dtype(data, scale, elem, 32, torch.float32).view(torch.int32))
                    check(name + " to bf16", cpp_mx[i + 3], to_dtype(data, scale, elem, 32, torch.bfloat16).view(torch.int16))
                    i += 4
    j = 0
    for c, x in enumerate(nv_cases):
        for dtype in (torch.float32, torch.bfloat16):
            for tiles in ((1, 16), (16, 16)):
                name = f"nvfp4 case {c} {str(dtype)[6:]} {tiles[0]}x{tiles[1]}"
                qx, sx, amax = nvfp4_quantize_rowwise(x.to(dtype), tiles)
                check(name + " codes", cpp_nv[j], qx)
                check(name + " scales", cpp_nv[j + 1], as_bytes(sx))
                check(name + " global amax", cpp_nv[j + 2], amax.view(torch.int32))
                deq = nvfp4_dequantize(qx, sx, per_tensor_amax_to_scale(amax))
                check(name + " dequantized", cpp_nv[j + 3], deq.view(torch.int32))
                j += 4
    for dtype in (torch.float32, torch.bfloat16):
        x = rht_in.to(dtype)
        name = f"hadamard {str(dtype)[6:]}"
        r = _apply_rht(x)
        check(name, cpp_nv[j], r.view(torch.int32 if dtype == torch.float32 else torch.int16))
        qx, sx, amax = nvfp4_quantize_columnwise_rht(x)
        check(name + " wgrad operand codes", cpp_nv[j + 1], qx)
        check(name + " wgrad operand scales", cpp_nv[j + 2], as_bytes(sx))
        check(name + " wgrad operand amax", cpp_nv[j + 3], amax.view(torch.int32))
        j += 4
    cpp_swizzle = torch.load(f"{out}/cpp_swizzle.pt", weights_only=False)
    # Each scale matrix swizzled as bytes, as e4m3 (NVFP4's scales) and, where
    # torch has it, as e8m0 (MXFP8's): torchao's to_blocked in each dtype.
    views = [torch.uint8, torch.float8_e4m3fn] + ([torch.float8_e8m0fnu] if HAS_E8M0 else [])
    s = 0
    while s < len(cpp_swizzle):
        scale = cpp_swizzle[s]
        for v, dtype in enumerate(views):
            name = f"to_blocked {list(scale.shape)} as {str(dtype)[6:]}"
            check(name, cpp_swizzle[s + 1 + v], as_bytes(to_blocked(scale.view(dtype))))
        s += 1 + len(views)
    cpp_train = torch.load(f"{out}/cpp_train.pt", weights_only=False)
    k = 0
    for mode, hp in (("rceil", False), ("floor", False), ("rceil", True)):
        ours = train(mode, hp)
        name = f"mxfp8 linear training {mode}{' wgrad_with_hp' if hp else ''}"
        check(name + " losses", cpp_train[k], ours[0])
        first = next((s for s in range(ours[0].numel()) if cpp_train[k][s] != ours[0][s]), None)
        if first is not None:
            failures.append(f"{name}: the losses part at step {first}")
        for p, t in enumerate(ours[1:]):
            check(f"{name} parameter {p}", cpp_train[k + 1 + p], t)
        k += len(ours)
    cpp_blocks = torch.load(f"{out}/cpp_blocks.pt", weights_only=False)
    b = 0
    for recipe in ("rceil", "floor", "nvfp4"):
        ours = train_blocks(recipe)
        name = f"2-block transformer {recipe}"
        check(name + " losses", cpp_blocks[b], ours[0])
        first = next((s for s in range(ours[0].numel()) if cpp_blocks[b][s] != ours[0][s]), None)
        if first is not None:
            failures.append(f"{name}: the losses part at step {first}")
        for p, t in enumerate(ours[1:]):
            check(f"{name} parameter {p}", cpp_blocks[b + 1 + p], t)
        b += len(ours)
    if s != len(cpp_swizzle):
        failures.append(f"the C++ half wrote {len(cpp_swizzle)} swizzle tensors, the twin read {s}")
    if i != len(cpp_mx) or j != len(cpp_nv) or k != len(cpp_train) or b != len(cpp_blocks):
        failures.append(f"the C++ half wrote {len(cpp_mx)} MX and {len(cpp_nv)} NVFP4 tensors, the twin read {i} and {j}")
    for f in failures:
        print("FAIL", f)
    print(f"block_scaled_twin: torch {torch.__version__}, {compared} comparisons, {len(failures)} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
