"""Our own Llama-family forward over a ragged token batch and a paged KV cache.

Weights are re-laid out once at load: every projection is stored as [in, out]
(``x @ W``), which MKL streams ~1.4x faster than ``F.linear`` for the thin
matrices of decode; q/k/v and gate/up are fused into one matmul each. The math
(RMSNorm, rotary embedding, SiLU MLP, residual order) mirrors ``transformers``
so that greedy output matches its ``generate`` token for token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from splitserve.engine.errors import ModelLoadError
from splitserve.engine.loader import LoadedModel
from splitserve.engine.native import gguf_blocks


@dataclass(frozen=True)
class ModelShape:
    """The numbers that shape the KV cache and the forward."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_eps: float
    kv_dtype: str = "float32"  # the KV cache's (and the engine's) dtype, by torch's name

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape of a model config (a LoadedModel's), without building the model."""
        return cls(
            model_type=cfg.model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            max_position=cfg.context_length,
            rms_eps=cfg.rms_norm_eps,
        )

    @property
    def kv_itemsize(self) -> int:
        return 4 if self.kv_dtype == "float32" else 2

    @property
    def kv_bytes_per_token(self) -> int:  # K and V over every layer
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_itemsize


@dataclass
class Layer:
    ln1: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [H, (Hq + 2*Hkv) * D]
    b_qkv: torch.Tensor | None  # [(Hq + 2*Hkv) * D] (Qwen2)
    w_o: torch.Tensor  # [Hq*D, H]
    ln2: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [H, 2*I]
    w_down: torch.Tensor  # [I, H]
    packed: dict | None = None  # the same weights packed for SmallGemm (native.Packed)


LAID_OUT = ("w_qkv", "w_o", "w_gate_up", "w_down")  # a layer's weights made [in, out] (LlamaModel.laid_out)


class LlamaModel:
    def __init__(self, loaded: LoadedModel, laid_out: dict | None = None, dtype: str = "float32"):
        """``laid_out``: the weights in this model's layout already, by laid_out()'s names (from an
        earlier model on the same weights, or layout_cache); one whose shape or dtype is not the one
        this model makes is made again (self.made_layout says whether any was). ``dtype``: what the
        weights, the activations and the KV cache are kept in (logits are float32 whatever it is)."""
        cfg = loaded.config
        head_dim = cfg.head_dim
        self.dtype = getattr(torch, dtype)
        self.shape = dataclasses.replace(ModelShape.of(cfg), kv_dtype=dtype)
        self.name = loaded.name
        self.scaling = head_dim**-0.5
        sd = loaded.state_dict
        try:
            self.embed = self._cast(sd["model.embed_tokens.weight"]).contiguous()  # [V, H]
            self.made_layout = False
            laid = laid_out or {}
            self.lm_head = self._weight(laid, "lm_head", sd.get("lm_head.weight", self.embed))  # [H, V]
            self.lm_head_name = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
            self.norm = self._cast(sd["model.norm.weight"])
            self.layers = [self._layer(sd, i, laid) for i in range(self.shape.num_layers)]
        except KeyError as e:
            raise ModelLoadError(f"weights are missing tensor {e.args[0]}") from None
        cos, sin = cfg.rope_tables()  # float32, cast to the activations' dtype as transformers does
        half = head_dim // 2
        self.rope_cos = self._cast(cos)  # [max_pos, D]
        # rotate_half(x) * sin == roll(x, half) * sin_signed, exactly (negation is exact)
        self.rope_sin = self._cast(torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))  # [max_pos, D]
        self.fingerprint = _fingerprint(self.shape, cfg, sd)
        self.attn_kernel = None  # native.PagedAttention, set by the engine when available
        self.fused = None  # fused.FusedOps (CUDA: Triton), set by the engine when available
        self.small_gemm = None  # native.SmallGemm, set by use_small_gemm()
        self.invariant = False  # every matmul through small_gemm, MAX_M rows at a time (EngineConfig.batch_invariant)
        self.on_layer = None  # called before every layer (the engine's CoreShare.tick)
        self.lm_head_packed = None  # native.Packed
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> None:
        """Move the weights and rotary tables (the fingerprint was taken on the host copy)."""
        if device == self.device:
            return
        assert self.small_gemm is None, "the small-GEMM kernel is CPU only"
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.embed, self.lm_head, self.norm = move(self.embed), move(self.lm_head), move(self.norm)
        self.rope_cos, self.rope_sin = move(self.rope_cos), move(self.rope_sin)
        self.layers = [
            dataclasses.replace(
                layer, **{f.name: move(getattr(layer, f.name)) for f in dataclasses.fields(Layer) if f.name != "packed"}
            )
            for layer in self.layers
        ]
        self.device = device

    def use_small_gemm(
        self,
        small_gemm,
        between: Callable[[], None] | None = None,
        cache: dict | None = None,
        known: dict | None = None,
        blocks: dict | None = None,
    ) -> None:
        """Route matmuls of up to SmallGemm.MAX_M rows (decode steps, short chunks) to the weight-streaming
        kernel. ``between`` is called before each layer's packing (the engine's CoreShare.tick). ``cache``
        (LoadedModel.packed) keeps the packed weights for the next model built on the same ones; ``known``:
        them as an earlier process packed them (pack_cache.read), by the same keys, blocks or tiles taken as
        they are. ``blocks``: the checkpoint's own blocks by HF name (loader.native_blocks): a weight
        not in ``known`` whose parts all have blocks of one format is read from them, the others from
        fp32 tiles."""
        cache = {} if cache is None else cache
        known = known or {}

        def pack(key, w, *parts: str):
            before = known.get(key)
            if before is not None and before.blocks is not None:  # read back from the disk cache
                return small_gemm.pack(w, before, (before.fmt, before.blocks))
            got = [blocks.get(p) for p in parts] if blocks is not None else [None]
            fmts = {g[0] for g in got if g is not None}
            if None in got or len(fmts) != 1 or not small_gemm.fits_blocks(*w.shape):
                return small_gemm.pack(w, before)
            fmt = fmts.pop()
            raw = got[0][1] if len(got) == 1 else np.concatenate([g[1] for g in got])
            return small_gemm.pack(w, None, (fmt, gguf_blocks(fmt, torch.from_numpy(raw))))

        parts = {
            "w_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "w_o": ("self_attn.o_proj",),
            "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "w_down": ("mlp.down_proj",),
        }
        for i, layer in enumerate(self.layers):
            if between is not None:
                between()
            for name, of in parts.items():
                if (i, name) not in cache:
                    cache[i, name] = pack(
                        (i, name), getattr(layer, name), *(f"model.layers.{i}.{x}.weight" for x in of)
                    )
            layer.packed = {name: cache[i, name] for name in parts}
        if "lm_head" not in cache:
            cache["lm_head"] = pack("lm_head", self.lm_head, self.lm_head_name)
        self.lm_head_packed = cache["lm_head"]
        self.small_gemm = small_gemm

    def mm(self, x: torch.Tensor, layer: Layer | None, name: str) -> torch.Tensor:
        """x @ W for one of a layer's weights (layer None: the lm_head)."""
        w = self.lm_head if layer is None else getattr(layer, name)
        m = self.small_gemm.MAX_M if self.small_gemm is not None else 0
        if 0 < x.shape[0] <= m:
            packed = self.lm_head_packed if layer is None else layer.packed[name]
            return self.small_gemm(x, packed, w.shape[1])
        if self.invariant and x.shape[0] > m:  # each row's result its own, as in a short step
            packed = self.lm_head_packed if layer is None else layer.packed[name]
            return torch.cat([self.small_gemm(x[i : i + m], packed, w.shape[1]) for i in range(0, x.shape[0], m)])
        return torch.mm(x, w)

    def laid_out(self) -> dict[str, torch.Tensor]:
        """The weights this model made from the [out, in] tensors it was loaded with, by name: what
        a later model on the same weights takes as laid_out."""
        return {
            "lm_head": self.lm_head,
            **{f"{i}.{name}": getattr(layer, name) for i, layer in enumerate(self.layers) for name in LAID_OUT},
        }

    def _weight(self, laid: dict, name: str, *parts: torch.Tensor) -> torch.Tensor:
        """The [in, out] weight of the [out, in] parts, concatenated: laid out already (in laid), or made."""
        got = laid.get(name)
        if (
            got is not None
            and got.dtype == self.dtype
            and got.is_contiguous()
            and tuple(got.shape) == (parts[0].shape[1], sum(x.shape[0] for x in parts))
        ):
            return got
        self.made_layout = True
        parts = [self._cast(x) for x in parts]
        return (torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]).t().contiguous()

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)

    def _layer(self, sd: dict, i: int, laid: dict) -> Layer:
        p = f"model.layers.{i}."
        w = lambda name: sd[p + name]  # noqa: E731
        bias = None
        if p + "self_attn.q_proj.bias" in sd:
            bias = self._cast(
                torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
            )
        return Layer(
            ln1=self._cast(w("input_layernorm.weight")),
            w_qkv=self._weight(
                laid,
                f"{i}.w_qkv",
                w("self_attn.q_proj.weight"),
                w("self_attn.k_proj.weight"),
                w("self_attn.v_proj.weight"),
            ),
            b_qkv=bias,
            w_o=self._weight(laid, f"{i}.w_o", w("self_attn.o_proj.weight")),
            ln2=self._cast(w("post_attention_layernorm.weight")),
            w_gate_up=self._weight(laid, f"{i}.w_gate_up", w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")),
            w_down=self._weight(laid, f"{i}.w_down", w("mlp.down_proj.weight")),
        )

    # -- pieces shared by the ragged and the padded forward ---------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of six launches
            return F.rms_norm(x, (x.shape[-1],), weight, self.shape.rms_eps)
        # Same ops as transformers' LlamaRMSNorm: in fp32, cast back before the weight (no-ops in fp32).
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return weight * (xf * torch.rsqrt(var + self.shape.rms_eps)).to(x.dtype)

    def qkv(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write=None):
        """h: [T, H] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], rotary applied to q and k.

        write (slot_mapping [T], k_cache, v_cache) also stores k and v in the paged cache."""
        s = self.shape
        if self.fused is not None:  # one projection (with its bias) and one kernel for the rest
            w = layer.w_qkv
            qkv = torch.mm(h, w) if layer.b_qkv is None else torch.addmm(layer.b_qkv, h, w)
            return self.fused.rope_qkv(qkv, cos, sin, *(write or ()))
        qkv = self.mm(h, layer, "w_qkv")
        if layer.b_qkv is not None:
            qkv = qkv + layer.b_qkv
        qkv = qkv.view(h.shape[0], s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        qk = qkv[:, : s.num_heads + s.num_kv_heads]
        qk = qk * cos + torch.roll(qk, s.head_dim // 2, dims=-1) * sin  # cos/sin: [T, 1, D]
        q, k, v = qk[:, : s.num_heads], qk[:, s.num_heads :], qkv[:, s.num_heads + s.num_kv_heads :]
        if write is not None:
            slots, k_cache, v_cache = write
            k_cache.index_copy_(0, slots, k)
            v_cache.index_copy_(0, slots, v)
        return q, k, v

    def mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        gu = self.mm(x, layer, "w_gate_up")
        inter = gu.shape[-1] // 2
        return self.mm(F.silu(gu[:, :inter]) * gu[:, inter:], layer, "w_down")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [S, H] final hidden states of the rows to sample -> [S, V]."""
        return self.lm_head_of(self.rms_norm(h, self.norm))

    def head(self, h: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        """The forward's result from the final hidden states of batch.logits_rows: their logits, or,
        with batch.hidden_out, the states after the final norm (lm_head_of() makes logits of them)."""
        normed = self.rms_norm(h, self.norm)
        return normed if batch.hidden_out else self.lm_head_of(normed)

    def lm_head_of(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, V] of normed final hidden states [S, H] (a forward's, with batch.hidden_out)."""
        return self.mm(h, None, "lm_head").float()

    # -- ragged forward over the paged cache ---------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, kv: torch.Tensor) -> torch.Tensor:
        """One forward over every scheduled token; returns logits for ``batch.logits_rows`` (with
        ``batch.hidden_out``, their normed final hidden states: see head()).

        kv: [layers, 2, slots, Hkv, D], the paged cache (slot = block * block_size + offset).
        """
        x = self.embed[batch.input_ids]  # [T, H]
        cos, sin = self.rope(batch.positions)
        last = len(self.layers) - 1
        for li in range(len(self.layers)):
            if self.on_layer is not None:
                self.on_layer()
            q, k, v = self.attn_in(li, x, cos, sin, kv, batch.slot_mapping)
            attn = batch.attention(
                q, k, v, kv[li, 0], kv[li, 1], self.scaling, self.attn_kernel, fused=self.fused
            )  # [T, Hq*D]
            if li == last and batch.logits_rows.shape[0] < x.shape[0]:
                # Past the last K/V write only the sampled rows matter: a prefill's other rows skip
                # the last layer's output projection and MLP (~2.8% of a prefill's FLOPs here).
                rows = batch.logits_rows
                return self.head(self.attn_out(li, x[rows], attn[rows]), batch)
            x = self.attn_out(li, x, attn)
        return self.head(x[batch.logits_rows], batch)

    # Layer halves around attention (the forward above; cuda_graphs.py captures them).

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of positions [T]."""
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def attn_in(self, li: int, x, cos, sin, kv: torch.Tensor, slot_mapping: torch.Tensor):
        """Layer li up to attention: norm, q/k/v with rotary, and the new K/V written to the cache."""
        layer = self.layers[li]
        return self.qkv(layer, self.rms_norm(x, layer.ln1), cos, sin, (slot_mapping, kv[li, 0], kv[li, 1]))

    def attn_out(self, li: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer li after attention: output projection and MLP, each added to the residual x."""
        layer = self.layers[li]
        if self.fused is not None:  # the residual adds in the matmuls' epilogue, SiLU * up in one kernel
            x = torch.addmm(x, attn, layer.w_o)
            gu = torch.mm(self.rms_norm(x, layer.ln2), layer.w_gate_up)
            return torch.addmm(x, self.fused.silu_mul(gu), layer.w_down)
        x = x + self.mm(attn, layer, "w_o")
        return x + self.mlp(layer, self.rms_norm(x, layer.ln2))

    # -- padded forward (static / dynamic batching) ----------------------------------------------

    @torch.inference_mode()
    def forward_padded(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        kv: torch.Tensor,
        start: int | torch.Tensor,
    ) -> torch.Tensor:
        """A rectangular batch, the way static/dynamic batching systems run it.

        input_ids, positions: [B, L]; mask: [B, 1, L, start + L] bool;
        kv: [layers, 2, B, Hkv, max_len, D], written at [start, start + L).
        start may be a one-element device tensor when L == 1 (a captured decode step): the
        write is then an index_copy_ and attention reads all of kv, mask [B, 1, 1, max_len].
        Returns logits of each row's last position: [B, V].
        """
        s = self.shape
        B, L = input_ids.shape
        x = self.embed[input_ids.flatten()]  # [B*L, H]
        pos = positions.flatten()
        cos, sin = self.rope(pos)
        rect = (B, L, s.num_kv_heads, s.head_dim)
        for li, layer in enumerate(self.layers):
            if self.on_layer is not None:
                self.on_layer()
            q, k, v = self.qkv(layer, self.rms_norm(x, layer.ln1), cos, sin)
            kc, vc = _write_rect(kv[li], k.view(rect), v.view(rect), start)
            if L == 1 and x.is_cuda:  # decode: q is [B, Hq, D]
                attn = sdpa_decode(q, kc, vc, mask, self.scaling)
            else:
                qh = q.view(B, L, s.num_heads, s.head_dim).transpose(1, 2)  # [B, Hq, L, D]
                attn = sdpa_gqa(qh, kc, vc, mask, False, self.scaling).transpose(1, 2).reshape(B * L, -1)
            x = self.attn_out(li, x, attn)
        return self.logits(x.view(B, L, -1)[:, -1])


def _write_rect(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor):
    """Write k, v [B, L, Hkv, D] into one layer's kv [2, B, Hkv, max_len, D] from start;
    return the K and V caches attention reads ([B, Hkv, start + L, D], or all of max_len)."""
    if isinstance(start, torch.Tensor):
        kv[0].index_copy_(2, start, k.transpose(1, 2))
        kv[1].index_copy_(2, start, v.transpose(1, 2))
        return kv[0], kv[1]
    end = start + k.shape[1]
    kv[0, :, :, start:end] = k.transpose(1, 2)
    kv[1, :, :, start:end] = v.transpose(1, 2)
    return kv[0, :, :, :end], kv[1, :, :, :end]


def _fingerprint(shape: ModelShape, cfg, sd: dict) -> str:
    """Hash of what shapes the KV plus a sample of the weights that write it."""
    h = hashlib.sha256()
    desc = dict(shape.__dict__)
    del desc["kv_dtype"]  # the weights' identity; a handle's dtype is checked by name (handoff.layout.check)
    desc["rope"] = cfg.rope
    h.update(json.dumps(desc, sort_keys=True).encode())
    h.update(sd["model.layers.0.self_attn.k_proj.weight"].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


from splitserve.engine.attention import RaggedBatch, sdpa_decode, sdpa_gqa  # noqa: E402  (used above)
