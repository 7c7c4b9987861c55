"""U-Net Transformer (Donahue et al., 2020) and its ablations as switches of one encoder.

Encoder stack (``n_layers`` = 2 + 2 * n_down; the paper's 6): an in-layer, ``n_down``
down layers, ``n_down`` up layers and an out-layer. Layer ``i`` has a size level (0 for
in/out, rising by one per down layer and falling per up layer); its output width is
``round(d_model * width_growth**level)`` ([256, 362, 512, 362, 256, 256] in the paper) and
its per-head size and FFN width scale the same way (64 and 1024 times sqrt(2)**level).
Heads stay ``n_heads`` throughout.

One layer (``UNetLayer``), with ``x`` the layer input:

    q   = LayerNorm(resample(Linear(DepthwiseConv_k3(x))) [+ x if the layer keeps its size])
    h   = LayerNorm(q + Attention(query=q, keys/values=x))
    out = LayerNorm(h + FFN(h)) * non_pad

``resample`` is MaxPool1d(3, 2, 1) in down layers (length ceil(L/2)); an up layer replaces
the stride-1 depthwise conv with a depthwise ConvTranspose1d(3, stride 2, pad 1) whose
``output_size`` is the matching down layer's input length, so odd lengths come back exactly.
A down output is padding iff its whole pooling window is padding (the mask is max-pooled
the same way), judged on the row as if it were alone: a row of even real length 2k pools
to k outputs, and the (k+1)-th window that batch padding adds, which holds only the row's
last token (already pooled by window k), stays padding. Otherwise a row's output would
depend on how much padding its batch has. The attention mask is query-non-pad x
key-non-pad; pad outputs are zero.

Skip connections (the authors' code): the output of every layer on the way down (the
in-layer and each down layer but the last) is added to the output of the up layer of the
same width and length, and the sum feeds the next layer. The bottleneck feeds the first up
layer directly. ``linear_skip`` passes the skipped tensor through a Linear first
(UNET+LINEAR).

Switches (each changes only what it names; ``tests/models/test_unet.py`` checks it):
- ``skip``: the additions above;
- ``conv``: the conv module that builds the query (off: ``q = x``, a plain encoder layer);
- ``down_up``: max-pool / transposed-conv resampling (off: every layer keeps the length);
- ``linear_skip``: a Linear on each skip;
- ``per_layer_attention``: decoder layer i attends encoder layer i's output (as the layer
  computed it, before any skip is added) instead of the last one (UNET+PER-LAYER-ATT).

Registered names: ``unet``; ``unet_linear``; ``unet_per_layer_att``; ``transformer_skip``
(+SKIP: skips in a constant-width, constant-length stack without conv); and
``transformer_skip_conv`` (+SKIP+CONV: plus the conv module, no resampling, no widening).
With every switch off and ``width_growth=1`` the model computes exactly ``transformer``.
"""

from __future__ import annotations

import enum
import math

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline.models.base import RESIDUAL_INIT_GAIN
from pipeline.models.layers import FeedForward, MultiHeadAttention, xavier_
from pipeline.models.registry import register
from pipeline.models.seq2seq import EncoderDecoder, EncoderDecoderConfig, EncoderMemory
from pipeline.names import Task


def _needs(flag: bool, info: ValidationInfo, earlier: str, why: str = "") -> bool:
    """``flag``, unless it is true while the switch ``earlier`` (validated before it) is
    false: then the error says so (``why``: the reason)."""
    if flag and info.data.get(earlier) is False:
        raise ValueError(f"true needs {earlier}=true{why}")
    return flag


class UNetConfig(EncoderDecoderConfig):
    """The U-Net paper's sizes and the ablation switches (defaults: the full U-Net)."""

    n_layers: int = Field(6, ge=2)
    width_growth: float = Field(math.sqrt(2), ge=1.0)
    skip: bool = True
    conv: bool = True
    down_up: bool = Field(True, validate_default=True)
    linear_skip: bool = False
    per_layer_attention: bool = False

    # Field validators (each on the later field of a constraint) so errors name the field.
    @field_validator("n_layers")
    @classmethod
    def _even(cls, n_layers: int) -> int:
        if n_layers % 2:
            raise ValueError(f"must be even (in + down + up + out layers), got {n_layers}")
        return n_layers

    @field_validator("conv")
    @classmethod
    def _conv_widens(cls, conv: bool, info: ValidationInfo) -> bool:
        growth = info.data.get("width_growth", 1.0)
        if not conv and growth != 1.0:
            raise ValueError(
                f"false needs width_growth=1 (got {growth}): only the conv module widens"
            )
        return conv

    @field_validator("down_up")
    @classmethod
    def _resampling_needs_conv(cls, down_up: bool, info: ValidationInfo) -> bool:
        return _needs(down_up, info, "conv", ": resampling is part of the conv module")

    @field_validator("linear_skip")
    @classmethod
    def _linear_needs_skip(cls, linear_skip: bool, info: ValidationInfo) -> bool:
        return _needs(linear_skip, info, "skip")

    @field_validator("per_layer_attention")
    @classmethod
    def _one_memory_per_layer(cls, per_layer: bool, info: ValidationInfo) -> bool:
        n_enc, n_dec = info.data.get("n_layers"), info.data.get("n_decoder_layers")
        if per_layer and n_enc != n_dec:
            raise ValueError(
                f"true needs as many decoder as encoder layers, got {n_dec} and {n_enc}"
            )
        return per_layer

    @property
    def n_down(self) -> int:
        return (self.n_layers - 2) // 2

    @property
    def levels(self) -> list[int]:
        """Size level of each encoder layer: [0, 1..n_down, n_down-1..0, 0]."""
        down = list(range(1, self.n_down + 1))
        return [0, *down, *reversed(range(self.n_down)), 0]

    def _scaled(self, base: int) -> list[int]:
        return [round(base * self.width_growth**level) for level in self.levels]

    @property
    def widths(self) -> list[int]:
        return self._scaled(self.d_model)

    @property
    def head_sizes(self) -> list[int]:
        return self._scaled(self.head_size)

    @property
    def ffn_sizes(self) -> list[int]:
        return self._scaled(self.d_ff)


class Resample(enum.Enum):
    """How a layer changes the sequence length."""

    NONE = "none"
    DOWN = "down"
    UP = "up"


def pool_mask(mask: Tensor) -> Tensor:
    """``[B, L]`` real-token mask -> ``[B, ceil(L/2)]`` mask of MaxPool1d(3, 2, 1) outputs.

    An output is real iff its window holds a real position (the paper) and its window
    exists for the row alone, i.e. its centre lies within the row's real extent; for the
    right-padded histories of ``GenerateBatch`` this is ``mask[:, ::2]``.
    """
    length = mask.shape[1]
    any_real = F.max_pool1d(mask.float().unsqueeze(1), 3, 2, 1).squeeze(1) > 0
    positions = torch.arange(1, length + 1, device=mask.device)
    extent = (positions * mask).max(dim=1, keepdim=True).values  # last real position + 1
    centres = torch.arange(0, length, 2, device=mask.device)
    return any_real & (centres < extent)


class ConvModule(nn.Module):
    """Depthwise conv (k=3) -> Linear(d_in -> d_out) -> max-pool (down layers); up layers use
    a depthwise stride-2 transposed conv instead of the stride-1 conv and do not pool.
    Produces the layer's query before its LayerNorm."""

    def __init__(self, d_in: int, d_out: int, resample: Resample) -> None:
        super().__init__()
        self.resample = resample
        if resample is Resample.UP:
            self.depthwise: nn.Conv1d | nn.ConvTranspose1d = nn.ConvTranspose1d(
                d_in, d_in, 3, stride=2, padding=1, groups=d_in
            )
        else:
            self.depthwise = nn.Conv1d(d_in, d_in, 3, padding=1, groups=d_in)
        nn.init.xavier_uniform_(self.depthwise.weight)  # the paper: Xavier everywhere
        nn.init.zeros_(self.depthwise.bias)  # type: ignore[arg-type]
        self.linear = xavier_(nn.Linear(d_in, d_out))

    def forward(self, x: Tensor, in_mask: Tensor, out_mask: Tensor) -> Tensor:
        """``x`` ``[B, L, d_in]`` (zero at padding) -> ``[B, L_out, d_out]``, ``L_out`` being
        ``out_mask``'s length.

        Padding enters the pool as -inf, so a window reaching into padding pools only its
        real positions, exactly as at the end of an unpadded row (batched == one by one).
        """
        h = x.transpose(1, 2)
        if self.resample is Resample.UP:
            h = self.depthwise(h, output_size=[out_mask.shape[1]])
        else:
            h = self.depthwise(h)
        h = self.linear(h.transpose(1, 2))
        if self.resample is Resample.DOWN:
            h = h.masked_fill(~in_mask.unsqueeze(-1), float("-inf"))
            h = F.max_pool1d(h.transpose(1, 2), 3, 2, 1).transpose(1, 2)
            h = h.masked_fill(~out_mask.unsqueeze(-1), 0.0)
        return h


class UNetLayer(nn.Module):
    """One U-Net encoder layer (module docstring); without ``conv`` it is exactly
    ``blocks.EncoderLayer`` (same parameter names) with pad outputs zeroed."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        n_heads: int,
        d_head: int,
        d_ff: int,
        dropout: float,
        conv: bool,
        resample: Resample,
        attention_dropout: float | None = None,
        output_gain: float = RESIDUAL_INIT_GAIN,
    ) -> None:
        super().__init__()
        if not conv and (d_in != d_out or resample is not Resample.NONE):
            raise ValueError("a layer without the conv module cannot change size")
        self.resample = resample
        self.conv = ConvModule(d_in, d_out, resample) if conv else None
        self.norm_conv = nn.LayerNorm(d_out) if conv else None
        # The conv module's residual exists only where the layer keeps its size.
        self.conv_residual = conv and d_in == d_out and resample is Resample.NONE
        p_attn = dropout if attention_dropout is None else attention_dropout
        self.attn = MultiHeadAttention(
            d_out, n_heads, d_head, d_kv=d_in, dropout=p_attn, output_gain=output_gain
        )
        self.ffn = FeedForward(d_out, d_ff, dropout, output_gain=output_gain)
        self.norm_attn = nn.LayerNorm(d_out)
        self.norm_ffn = nn.LayerNorm(d_out)
        self.dropout = nn.Dropout(dropout)

    def query(self, x: Tensor, in_mask: Tensor, out_mask: Tensor) -> Tensor:
        """The attention query: the normalised conv module output, or ``x`` without conv."""
        if self.conv is None or self.norm_conv is None:
            return x
        q = self.conv(x, in_mask, out_mask)
        return self.norm_conv(q + x if self.conv_residual else q)

    def forward(self, x: Tensor, in_mask: Tensor, out_mask: Tensor) -> Tensor:
        """``x`` ``[B, L_in, d_in]`` with real-token masks of the input and of the output."""
        q = self.query(x, in_mask, out_mask)
        attn_mask = out_mask[:, None, :, None] & in_mask[:, None, None, :]
        h = self.norm_attn(q + self.dropout(self.attn(q, x, mask=attn_mask)))
        return self.norm_ffn(h + self.dropout(self.ffn(h))) * out_mask.unsqueeze(-1)


class UNetEncoder(nn.Module):
    """The U-Net stack; ``forward`` returns every layer's output and real-token mask."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        c = config
        widths, n_down = c.widths, c.n_down
        d_ins = [c.d_model, *widths[:-1]]
        resamples = [Resample.NONE] * c.n_layers
        if c.down_up:
            for i in range(1, n_down + 1):
                resamples[i], resamples[n_down + i] = Resample.DOWN, Resample.UP
        self.levels = c.levels
        self.layers = nn.ModuleList(
            UNetLayer(
                d_ins[i],
                widths[i],
                c.n_heads,
                c.head_sizes[i],
                c.ffn_sizes[i],
                c.dropout,
                c.conv,
                resamples[i],
                c.attention_dropout_p,
                c.residual_init_gain,
            )
            for i in range(c.n_layers)
        )
        # Up layer n_down + j receives the output of layer n_down - j (same width/length).
        self.skips = {n_down + j: n_down - j for j in range(1, n_down + 1)} if c.skip else {}
        self.skip_proj = (
            nn.ModuleDict(
                {str(t): xavier_(nn.Linear(widths[s], widths[s])) for t, s in self.skips.items()}
            )
            if c.linear_skip
            else None
        )

    def forward(self, x: Tensor, mask: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``x`` ``[B, L, d_model]`` (zero at padding), ``mask`` ``[B, L]`` -> per-layer
        outputs (before any skip is added) and their masks."""
        level_masks = [mask]
        outputs: list[Tensor] = []
        masks: list[Tensor] = []
        in_mask = mask
        for i, layer in enumerate(self.layers):
            if layer.resample is Resample.DOWN:
                level_masks.append(pool_mask(in_mask))
            out_mask = (
                level_masks[self.levels[i]] if layer.resample is not Resample.NONE else in_mask
            )
            out = layer(x, in_mask, out_mask)
            outputs.append(out)
            masks.append(out_mask)
            x = out
            if i in self.skips:
                skipped = outputs[self.skips[i]]
                if self.skip_proj is not None:
                    skipped = self.skip_proj[str(i)](skipped) * out_mask.unsqueeze(-1)
                x = x + skipped
            in_mask = out_mask
        return outputs, masks


class UNetTransformer(EncoderDecoder):
    """U-Net encoder + the Transformer's decoder (unchanged, as in the paper)."""

    def __init__(self, config: UNetConfig) -> None:
        c = config
        d_memory: int | list[int] = c.widths if c.per_layer_attention else c.widths[-1]
        dims = c.block(d_head=c.head_sizes[0])
        super().__init__(
            c.vocab_size, c.n_decoder_layers, dims, c.n_segments, d_memory, c.tie_output
        )
        self.config = config
        self.encoder = UNetEncoder(c)

    def encode_embedded(self, x: Tensor, mask: Tensor) -> EncoderMemory:
        outputs, masks = self.encoder(x, mask)
        if self.config.per_layer_attention:
            return EncoderMemory(outputs, masks)
        return EncoderMemory(outputs[-1], masks[-1])


# Registered names fix the switches (the paper's Tables 1, 2 and 6); sizes stay overridable.
_FULL = {
    "skip": True,
    "conv": True,
    "down_up": True,
    "linear_skip": False,
    "per_layer_attention": False,
}
register("unet", Task.GENERATE, UNetConfig, **_FULL)(UNetTransformer)
register("unet_linear", Task.GENERATE, UNetConfig, **{**_FULL, "linear_skip": True})(
    UNetTransformer
)
register("unet_per_layer_att", Task.GENERATE, UNetConfig, **{**_FULL, "per_layer_attention": True})(
    UNetTransformer
)
register(
    "transformer_skip",
    Task.GENERATE,
    UNetConfig,
    **{**_FULL, "conv": False, "down_up": False, "width_growth": 1.0},
)(UNetTransformer)
register(
    "transformer_skip_conv",
    Task.GENERATE,
    UNetConfig,
    **{**_FULL, "down_up": False, "width_growth": 1.0},
)(UNetTransformer)
