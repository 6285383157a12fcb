"""A tiny deterministic transformer whose attention reads its KV cache from a kvray backing.

It is the model-level proof of the data flow: prefill writes every cache layer through a block
table into the per-layer views of one backing, kvray moves the blocks' bytes to another backing
at other block ids, and decode there must generate exactly the tokens colocated generation
does. Every cache byte is read back, so a byte at a wrong address changes the tokens.

Three cache kinds, each a kvray layer of its own geometry, all `block_size` tokens a block:

- MLA-style layers cache one latent vector per token (parts=1); K and V are up-projections
  of the latent.
- GQA layers cache K and V separately (parts=2), `num_kv_heads` heads shared by the query heads.
- One indexer cache (uint8): a lightning-indexer key per token, int8-quantized with its float32
  scale packed beside it. Its scores pick the `index_topk` tokens every MLA layer attends to.

Weights are seeded random numbers (no downloads); compute is float32 on the device the views
live on (CPU or CUDA: the weights follow the views), built only from correctly rounded
elementwise operations (+, ×, ÷, sqrt, max, round) in a fixed order: no BLAS, no torch.exp or
erf, no reductions whose order depends on threads or SIMD width. The same tokens and cache bytes
therefore come out on any thread count and any CPU, so a prefill worker and a decode worker need
not share OMP_NUM_THREADS (torch's own matmul does differ in the last bit between 1 and 2
threads); on a GPU each of those operations is one elementwise kernel, so two processes on the
same kind of GPU agree to the bit as well. The price is a softmax whose exp is (1 + x/256)^256
and a ReLU MLP.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvray.errors import BlockIdError, ConfigError, LayoutError
from kvray.layout import BlockOrder, Geometry, KVLayout, LayerSpec, ceil_div
from kvray.memory import TORCH_DTYPES

#: The name of the indexer's cache layer.
INDEXER_LAYER = "model.indexer.k_cache"

#: Bytes of the float32 scale stored after an indexer key's int8 values.
_SCALE_NBYTES = 4
_INT8_MAX = 127.0
_NORM_EPS = 1e-6
#: Queries per attention chunk: bounds the [queries, keys, heads, dim] products of long prompts.
_QUERY_CHUNK = 64
#: Random weights are k / 2**23 for integers k in [-2**23, 2**23): exact floats in [-1, 1).
_WEIGHT_BITS = 23


class LayerKind(enum.Enum):
    """What a transformer layer caches."""

    #: One latent vector per token; K and V are its up-projections (DeepSeek-style MLA).
    MLA = "mla"
    #: Separate K and V of the KV heads (Llama-style grouped-query attention).
    KV = "kv"


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the reference model. Same config and seed: bit-identical weights."""

    vocab_size: int = 256
    hidden: int = 64
    mlp_hidden: int = 128
    num_heads: int = 4
    head_dim: int = 16
    #: KV heads of the GQA layers; the query heads are grouped over them.
    num_kv_heads: int = 2
    kv_dtype: str = "float16"
    #: Floats cached per token by each MLA layer.
    latent_dim: int = 48
    latent_dtype: str = "float32"
    indexer_heads: int = 2
    indexer_dim: int = 16
    #: How many cached tokens each MLA query attends to, chosen by the indexer.
    index_topk: int = 8
    #: The transformer layers in order; the indexer runs just before the first MLA layer.
    layer_kinds: tuple[LayerKind, ...] = (LayerKind.KV, LayerKind.MLA, LayerKind.KV, LayerKind.MLA)
    #: Tokens per block, the same for every cache layer.
    block_size: int = 4
    max_positions: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden": self.hidden,
            "mlp_hidden": self.mlp_hidden,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "num_kv_heads": self.num_kv_heads,
            "latent_dim": self.latent_dim,
            "indexer_heads": self.indexer_heads,
            "indexer_dim": self.indexer_dim,
            "index_topk": self.index_topk,
            "block_size": self.block_size,
            "max_positions": self.max_positions,
        }
        not_positive = {name: value for name, value in positive.items() if value <= 0}
        if not_positive:
            raise ConfigError(f"model sizes must be positive, got {not_positive}", **not_positive)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
            )
        if not self.layer_kinds:
            raise ConfigError("a model needs at least one layer")
        for name, dtype in (("kv_dtype", self.kv_dtype), ("latent_dtype", self.latent_dtype)):
            if dtype not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"{name} must be float32, bfloat16 or float16, got {dtype!r}", dtype=dtype)


DEFAULT_CONFIG = ModelConfig()


def encode_text(text: str) -> list[int]:
    """Byte-level tokens (vocabulary 256): the UTF-8 bytes of `text`."""
    return list(text.encode("utf-8"))


def decode_text(tokens: Sequence[int]) -> str:
    """The text of byte-level tokens; bytes that are not UTF-8 show as U+FFFD."""
    return bytes(tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class _Layer:
    """One transformer layer's weights (the K/V projections depend on the kind)."""

    kind: LayerKind
    cache_name: str
    w_q: torch.Tensor
    #: MLA: hidden -> latent. GQA: hidden -> K.
    w_a: torch.Tensor
    #: MLA: latent -> K and V of every head, side by side. GQA: hidden -> V.
    w_b: torch.Tensor
    w_o: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class _Indexer:
    w_q: torch.Tensor
    w_k: torch.Tensor
    w_weights: torch.Tensor


@dataclass(frozen=True)
class _Weights:
    """Every weight of the model, on one device."""

    embed: torch.Tensor
    positions: torch.Tensor
    unembed: torch.Tensor
    layers: tuple[_Layer, ...]
    indexer: _Indexer

    def to(self, device: torch.device) -> _Weights:
        def layer_to(layer: _Layer) -> _Layer:
            return _Layer(
                kind=layer.kind,
                cache_name=layer.cache_name,
                w_q=layer.w_q.to(device),
                w_a=layer.w_a.to(device),
                w_b=layer.w_b.to(device),
                w_o=layer.w_o.to(device),
                w_up=layer.w_up.to(device),
                w_down=layer.w_down.to(device),
            )

        return _Weights(
            embed=self.embed.to(device),
            positions=self.positions.to(device),
            unembed=self.unembed.to(device),
            layers=tuple(layer_to(layer) for layer in self.layers),
            indexer=_Indexer(
                w_q=self.indexer.w_q.to(device),
                w_k=self.indexer.w_k.to(device),
                w_weights=self.indexer.w_weights.to(device),
            ),
        )


@dataclass(frozen=True)
class _Table:
    """Where each token position of one sequence sits: (block id, slot) in the layer views,
    on the views' device."""

    block_ids: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.block_ids.device

    def addresses(self, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self.device)
        return self.block_ids[positions // block_size], positions % block_size


class ReferenceModel:
    """Greedy generation over a paged KV cache held in kvray layer views."""

    def __init__(self, config: ModelConfig = DEFAULT_CONFIG) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)

        def uniform(rows: int, cols: int, scale: float) -> torch.Tensor:
            # Integer draws, unlike torch.randn, give the same floats on every CPU.
            limit = 1 << _WEIGHT_BITS
            draws = torch.randint(-limit, limit, (rows, cols), generator=generator, dtype=torch.int64)
            return draws.to(torch.float32) * (scale / limit)

        def weight(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
            # Uniform on ±sqrt(3/rows): unit-variance inputs give unit-variance outputs.
            return uniform(rows, cols, gain * math.sqrt(3.0 / rows))

        c = config
        attention_width = c.num_heads * c.head_dim
        kv_width = c.num_kv_heads * c.head_dim
        embed = uniform(c.vocab_size, c.hidden, math.sqrt(3.0))
        positions = uniform(c.max_positions, c.hidden, 0.5 * math.sqrt(3.0))
        unembed = weight(c.hidden, c.vocab_size)
        layers: list[_Layer] = []
        for index, kind in enumerate(c.layer_kinds):
            if kind is LayerKind.MLA:
                w_a = weight(c.hidden, c.latent_dim)
                w_b = weight(c.latent_dim, 2 * attention_width)
            else:
                w_a = weight(c.hidden, kv_width)
                w_b = weight(c.hidden, kv_width)
            layers.append(
                _Layer(
                    kind=kind,
                    cache_name=f"model.layers.{index}.self_attn.{kind.value}",
                    # Gain on the queries sharpens attention, so the cache's contents matter.
                    w_q=weight(c.hidden, attention_width, gain=2.0),
                    w_a=w_a,
                    w_b=w_b,
                    w_o=weight(attention_width, c.hidden, gain=1.5),
                    w_up=weight(c.hidden, c.mlp_hidden),
                    w_down=weight(c.mlp_hidden, c.hidden),
                )
            )
        indexer = _Indexer(
            w_q=weight(c.hidden, c.indexer_heads * c.indexer_dim),
            w_k=weight(c.hidden, c.indexer_dim),
            w_weights=weight(c.hidden, c.indexer_heads),
        )
        self._layers = tuple(layers)
        # Weights are drawn on the CPU (the same bits everywhere) and copied to a device the
        # first time views there are used; compute threads of one worker share the copies.
        self._weights: dict[torch.device, _Weights] = {
            torch.device("cpu"): _Weights(embed, positions, unembed, self._layers, indexer)
        }
        self._weights_lock = threading.Lock()
        self._geometries = self._cache_geometries()

    def _weights_on(self, device: torch.device) -> _Weights:
        weights = self._weights.get(device)
        if weights is None:
            with self._weights_lock:
                weights = self._weights.get(device)
                if weights is None:
                    weights = self._weights[torch.device("cpu")].to(device)
                    self._weights[device] = weights
        return weights

    # ---- layout ------------------------------------------------------------------------

    def _cache_geometries(self) -> dict[str, Geometry]:
        """Every cache layer's geometry, in the order the forward pass writes them."""
        c = self.config
        mla = Geometry(block_size=c.block_size, entry_shape=(c.latent_dim,), dtype=c.latent_dtype)
        kv = Geometry(
            block_size=c.block_size, entry_shape=(c.num_kv_heads, c.head_dim), dtype=c.kv_dtype, parts=2
        )
        indexer = Geometry(
            block_size=c.block_size, entry_shape=(c.indexer_dim + _SCALE_NBYTES,), dtype="uint8"
        )
        geometries: dict[str, Geometry] = {}
        for layer in self._layers:
            if layer.kind is LayerKind.MLA and INDEXER_LAYER not in geometries:
                geometries[INDEXER_LAYER] = indexer
            geometries[layer.cache_name] = mla if layer.kind is LayerKind.MLA else kv
        return geometries

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The cache layers in layout order (the order prefill writes them)."""
        return tuple(self._geometries)

    def layout(self, num_blocks: int, block_order: BlockOrder = BlockOrder.LAYER_MAJOR) -> KVLayout:
        layers = tuple(LayerSpec(name=name, geometry=geometry) for name, geometry in self._geometries.items())
        return KVLayout(layers=layers, num_blocks=num_blocks, block_order=block_order)

    def blocks_needed(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.config.block_size)

    # ---- generation --------------------------------------------------------------------

    def prefill(
        self,
        tokens: Sequence[int],
        views: Mapping[str, torch.Tensor],
        block_table: Sequence[int],
        on_layer: Callable[[str], None] | None = None,
    ) -> int:
        """Run the prompt, write its KV into `views` at `block_table`, return the first new token.

        Token t goes to block `block_table[t // block_size]`, slot `t % block_size`.
        `on_layer(name)` is called right after each cache layer holds the whole prompt's KV.
        """
        if not tokens:
            raise ConfigError("prefill needs at least one token")
        self._check_tokens(tokens)
        self._check_positions(len(tokens))
        table = self._checked_table(views, block_table, len(tokens))
        with torch.no_grad():
            logits = self._forward(tokens, 0, views, table, on_layer)
        return int(torch.argmax(logits).item())

    def decode(
        self,
        first_token: int,
        prompt_len: int,
        views: Mapping[str, torch.Tensor],
        block_table: Sequence[int],
        max_new_tokens: int,
    ) -> list[int]:
        """Greedy generation after a prefilled prompt of `prompt_len` tokens.

        `first_token` (prefill's answer) is the first of the `max_new_tokens` returned tokens.
        Each token fed back is appended to the cache, so `block_table` must cover
        `prompt_len + max_new_tokens - 1` tokens (`blocks_needed(prompt_len + max_new_tokens)`
        always does).
        """
        if prompt_len <= 0 or max_new_tokens <= 0:
            raise ConfigError(
                f"decode needs a prompt and at least one new token, got prompt_len={prompt_len}, "
                f"max_new_tokens={max_new_tokens}",
                prompt_len=prompt_len,
                max_new_tokens=max_new_tokens,
            )
        self._check_tokens([first_token])
        cached_tokens = prompt_len + max_new_tokens - 1
        self._check_positions(cached_tokens)
        table = self._checked_table(views, block_table, cached_tokens)
        generated = [first_token]
        with torch.no_grad():
            for position in range(prompt_len, cached_tokens):
                logits = self._forward([generated[-1]], position, views, table, None)
                generated.append(int(torch.argmax(logits).item()))
        return generated

    def generate(
        self,
        tokens: Sequence[int],
        views: Mapping[str, torch.Tensor],
        block_table: Sequence[int],
        max_new_tokens: int,
    ) -> list[int]:
        """Colocated generation: prefill then decode on the same views and block table."""
        first_token = self.prefill(tokens, views, block_table)
        return self.decode(first_token, len(tokens), views, block_table, max_new_tokens)

    # ---- checks ------------------------------------------------------------------------

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [token for token in tokens if not 0 <= token < self.config.vocab_size]
        if bad:
            raise ConfigError(
                f"tokens must lie in [0, {self.config.vocab_size}), got {bad[:5]}", tokens=bad[:5]
            )

    def _check_positions(self, num_tokens: int) -> None:
        if num_tokens > self.config.max_positions:
            raise ConfigError(
                f"{num_tokens} tokens exceed the model's {self.config.max_positions} positions",
                num_tokens=num_tokens,
            )

    def _checked_table(
        self, views: Mapping[str, torch.Tensor], block_table: Sequence[int], num_tokens: int
    ) -> _Table:
        """Check the views against the layout and the block table against them."""
        num_blocks: int | None = None
        devices = {view.device for view in views.values()}
        if len(devices) > 1:
            raise LayoutError(
                f"the cache views live on several devices ({sorted(map(str, devices))}); a forward "
                "pass reads and writes them all on one"
            )
        for name, geometry in self._geometries.items():
            view = views.get(name)
            if view is None:
                raise LayoutError(f"no view for cache layer {name!r}", layer=name)
            block_shape = (geometry.block_size, *geometry.entry_shape)
            leading = 2 if geometry.parts == 2 else 1
            if (
                view.dim() != leading + len(block_shape)
                or tuple(view.shape[leading:]) != block_shape
                or (geometry.parts == 2 and view.shape[0] != 2)
                or view.dtype != TORCH_DTYPES[geometry.dtype]
            ):
                raise LayoutError(
                    f"view of {name!r} is {tuple(view.shape)} {view.dtype}, not "
                    f"[{'2, ' if leading == 2 else ''}num_blocks, {', '.join(map(str, block_shape))}] "
                    f"{geometry.dtype}",
                    layer=name,
                )
            layer_blocks = view.shape[leading - 1]
            if num_blocks is not None and layer_blocks != num_blocks:
                raise LayoutError(
                    f"views disagree on num_blocks ({layer_blocks} vs {num_blocks})", layer=name
                )
            num_blocks = layer_blocks
        assert num_blocks is not None
        needed = self.blocks_needed(num_tokens)
        used = list(block_table[:needed])
        if len(used) < needed:
            raise BlockIdError(
                f"{num_tokens} tokens need {needed} blocks, the block table has {len(block_table)}",
                needed=needed,
                given=len(block_table),
            )
        out_of_range = [block for block in used if not 0 <= block < num_blocks]
        if out_of_range or len(set(used)) != len(used):
            raise BlockIdError(
                f"block ids must be distinct and in [0, {num_blocks}), got {used}", block_ids=used
            )
        return _Table(block_ids=torch.tensor(used, dtype=torch.long, device=devices.pop()))

    # ---- the forward pass --------------------------------------------------------------

    def _forward(
        self,
        tokens: Sequence[int],
        start: int,
        views: Mapping[str, torch.Tensor],
        table: _Table,
        on_layer: Callable[[str], None] | None,
    ) -> torch.Tensor:
        """Logits after the last of `tokens`, which sit at positions start, start+1, ...

        Each layer first writes the new tokens' cache entries, then reads every cached token
        0..end-1 back from the views, so attention sees exactly the bytes in the backing.
        """
        c = self.config
        device = table.device
        weights = self._weights_on(device)
        end = start + len(tokens)
        query_positions = torch.arange(start, end, device=device)
        token_ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
        hidden = weights.embed[token_ids] + weights.positions[query_positions]
        causal = query_positions[:, None] >= torch.arange(end, device=device)[None, :]
        selected: torch.Tensor | None = None
        for layer in weights.layers:
            x = _rms_norm(hidden)
            if layer.kind is LayerKind.MLA:
                if selected is None:
                    selected = self._select_tokens(weights.indexer, x, start, end, causal, views, table)
                    _notify(on_layer, INDEXER_LAYER)
                latent = _rms_norm(_linear(x, layer.w_a))
                self._write(views[layer.cache_name], latent, start, end, table, part=None)
                _notify(on_layer, layer.cache_name)
                cached = self._read(views[layer.cache_name], end, table, part=None)
                keys, values = _linear(cached, layer.w_b).view(end, 2, c.num_heads, c.head_dim).unbind(1)
                mask = selected
            else:
                new_keys = _linear(x, layer.w_a).view(-1, c.num_kv_heads, c.head_dim)
                new_values = _linear(x, layer.w_b).view(-1, c.num_kv_heads, c.head_dim)
                self._write(views[layer.cache_name], new_keys, start, end, table, part=0)
                self._write(views[layer.cache_name], new_values, start, end, table, part=1)
                _notify(on_layer, layer.cache_name)
                # Each KV head serves `group` consecutive query heads.
                group = c.num_heads // c.num_kv_heads
                cache = views[layer.cache_name]
                keys = self._read(cache, end, table, part=0).repeat_interleave(group, dim=1)
                values = self._read(cache, end, table, part=1).repeat_interleave(group, dim=1)
                mask = causal
            queries = _linear(x, layer.w_q).view(-1, c.num_heads, c.head_dim)
            hidden = hidden + _linear(_attention(queries, keys, values, mask), layer.w_o)
            hidden = hidden + _linear(torch.relu(_linear(_rms_norm(hidden), layer.w_up)), layer.w_down)
        return _linear(_rms_norm(hidden[-1:]), weights.unembed)[0]

    def _select_tokens(
        self,
        indexer: _Indexer,
        x: torch.Tensor,
        start: int,
        end: int,
        causal: torch.Tensor,
        views: Mapping[str, torch.Tensor],
        table: _Table,
    ) -> torch.Tensor:
        """The lightning indexer: which cached tokens each query may attend to ([queries, end])."""
        c = self.config
        view = views[INDEXER_LAYER]
        self._write(view, _quantize(_linear(x, indexer.w_k)), start, end, table, part=None)
        keys = _dequantize(self._gather(view, end, table, part=None), c.indexer_dim)
        queries = _linear(x, indexer.w_q).view(-1, c.indexer_heads, c.indexer_dim)
        head_weights = _linear(x, indexer.w_weights)
        # score(t, s) = sum over heads h of w[t, h] * relu(q[t, h] . k[s]), as in DeepSeek-V3.2.
        chunks: list[torch.Tensor] = []
        for first in range(0, queries.shape[0], _QUERY_CHUNK):
            chunk = slice(first, first + _QUERY_CHUNK)
            dots = _sum_exact(queries[chunk, None, :, :] * keys[None, :, None, :], dim=-1)
            chunks.append(_sum_exact(torch.relu(dots) * head_weights[chunk, None, :], dim=-1))
        scores = torch.cat(chunks).masked_fill(~causal, -math.inf)
        # A stable sort keeps ties in position order, so the choice is the same every run.
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : c.index_topk]
        chosen = torch.zeros_like(causal).scatter_(1, order, True)
        return chosen & causal

    # ---- cache access ------------------------------------------------------------------

    def _write(
        self,
        view: torch.Tensor,
        entries: torch.Tensor,
        start: int,
        end: int,
        table: _Table,
        part: int | None,
    ) -> None:
        blocks, slots = table.addresses(start, end, self.config.block_size)
        target = view if part is None else view[part]
        target[blocks, slots] = entries.to(view.dtype)

    def _gather(self, view: torch.Tensor, end: int, table: _Table, part: int | None) -> torch.Tensor:
        """Tokens 0..end-1 of one layer (one part), as stored."""
        blocks, slots = table.addresses(0, end, self.config.block_size)
        source = view if part is None else view[part]
        return source[blocks, slots]

    def _read(self, view: torch.Tensor, end: int, table: _Table, part: int | None) -> torch.Tensor:
        return self._gather(view, end, table, part).to(torch.float32)


def _notify(on_layer: Callable[[str], None] | None, name: str) -> None:
    if on_layer is not None:
        on_layer(name)


def _sum_exact(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a fixed tree of elementwise adds: neighbours pair up, level by level.

    The same bits on any thread count or CPU, and zeros appended at the end (masked keys)
    leave the sum of the others unchanged to the last bit.
    """
    x = x.movedim(dim, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, torch.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] times weight [k, n], as products and an exact sum (matmul's bits vary with threads)."""
    return _sum_exact(x[..., :, None] * weight, dim=-2)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 as (1 + x/256)^256: eight squarings, correctly rounded on every CPU."""
    result = torch.clamp(1.0 + x / 256.0, min=0.0)
    for _ in range(8):
        result = result * result
    return result


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    mean_square = _sum_exact(x * x, dim=-1) / x.shape[-1]
    return x / torch.sqrt(mean_square + _NORM_EPS)[..., None]


def _attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """queries [q, heads, d], keys and values [s, heads, d], mask [q, s] -> [q, heads·d]."""
    scale = 1.0 / math.sqrt(queries.shape[-1])
    outputs: list[torch.Tensor] = []
    for first in range(0, queries.shape[0], _QUERY_CHUNK):
        chunk = slice(first, first + _QUERY_CHUNK)
        scores = _sum_exact(queries[chunk, None] * keys[None], dim=-1) * scale  # [q, s, heads]
        scores = scores.masked_fill(~mask[chunk, :, None], -math.inf)
        weights = _exp(scores - scores.amax(dim=1, keepdim=True))
        weights = weights / _sum_exact(weights, dim=1)[:, None]
        outputs.append(_sum_exact(weights[..., None] * values[None], dim=1))  # [q, heads, d]
    return torch.cat(outputs).flatten(1)


def _quantize(keys: torch.Tensor) -> torch.Tensor:
    """Float keys [n, d] -> [n, d + 4] uint8: int8 values, then the float32 scale's bytes."""
    amax = keys.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    values = torch.round(keys / scale).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def _dequantize(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_quantize`: [n, d + 4] uint8 -> float32 keys [n, d]."""
    values = packed[:, :dim].contiguous().view(torch.int8).to(torch.float32)
    scale = packed[:, dim:].contiguous().view(torch.float32)
    return values * scale


#: Model configurations shaped like kvray's ready-made layouts (`kvray.layout.READY_LAYOUTS`),
#: scaled down so a CPU generates quickly: MLA + indexer caches in bf16 (DeepSeek-V3), split
#: K/V in fp16 (Llama GQA), and all three kinds interleaved (mixed).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3": ModelConfig(
        layer_kinds=(LayerKind.MLA,) * 4, latent_dim=72, latent_dtype="bfloat16", block_size=8
    ),
    "llama": ModelConfig(layer_kinds=(LayerKind.KV,) * 4, kv_dtype="float16", block_size=4),
    "mixed": ModelConfig(),
}
