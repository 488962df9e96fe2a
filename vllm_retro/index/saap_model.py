"""SAAP's trained routing (Mazaré et al., 2025, ``../shared/seeds/003``): the file
``vllm-retro calibrate`` writes once per model, and the per-layer routing the serving index
(:mod:`vllm_retro.index.saap`) runs.

Per layer and KV head the file holds

- ``C`` **key centroids**: a spherical k-means of the layer's de-RoPEd keys (RoPE removed, so
  a bucket means the same at every position, paper §3 "Removing temporal bias"), centred on
  the keys' mean. A key goes to the bucket of its nearest centroid (largest cosine).
- a **query classifier** ``f_q`` (paper §4, §6.1): ``Linear(D, F) -> BatchNorm -> ReLU ->
  Linear(F, C)`` on the de-RoPEd query, trained so that its softmax matches the query's
  attention mass per bucket. At inference the batch norm is a fixed affine map, folded into
  the first layer here.

A decode query visits the ``l`` buckets with the largest ``sum_g softmax(f_q(q_g))`` over the
query heads ``g`` of the KV head's group (paper §5, "batched queries").

The file is a ``torch.save`` of plain tensors, strings and numbers (loaded with
``weights_only=True``: no pickled classes), with a format name and version, the identity of
the model it was trained for (architecture, layers, heads, head_dim, RoPE theta and a
fingerprint of the architecture fields of ``config.json``), the training settings and the
held-out quality measured at the end of training. :func:`load_saap` checks all of it and
raises :class:`SaapFileError` (one line, naming the file and what is wrong).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from vllm_retro import kernels
from vllm_retro.config import ConfigError

FORMAT_NAME = "vllm-retro-saap"
FORMAT_VERSION = 1

TENSORS = ("inv_freq", "key_mean", "centroids", "w1", "b1", "bn_weight", "bn_bias", "bn_mean",
           "bn_var", "w2", "b2")
"""The tensors of a file: ``inv_freq`` [R/2] (R the rotated dimensions), then per layer and
KV head ([L, H, ...]): ``key_mean`` [D], ``centroids`` [C, D] (unit norm), ``w1`` [F, D],
``b1`` [F], ``bn_weight``, ``bn_bias``, ``bn_mean``, ``bn_var`` [F], ``w2`` [C, F], ``b2``
[C] (fp32)."""

FINGERPRINT_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                      "rope_theta")
"""Architecture fields of a model's config hashed into :attr:`ModelIdentity.fingerprint`."""


class SaapFileError(ConfigError):
    """A SAAP file that is missing, unreadable, of another format or version, or trained for
    another model than the one served."""


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(params, Mapping):
        theta = params.get("rope_theta")
    return float(theta) if theta is not None else 10000.0


@dataclass(frozen=True)
class ModelIdentity:
    """What a SAAP file was trained for (from the model's Hugging Face config)."""

    architecture: str
    """``model_type`` (e.g. 'qwen2')."""
    num_layers: int
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    fingerprint: str
    """First 16 hex digits of the sha256 of :data:`FINGERPRINT_FIELDS`."""
    name: str = ""
    """The model's name or directory (informational, never compared)."""

    @classmethod
    def of(cls, config: Any, name: str = "") -> ModelIdentity:
        """The identity of a model from its config: a ``transformers`` config object (vLLM's
        ``hf_config``) or the dict of its ``config.json``."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        cfg = dict(cfg.get("text_config") or cfg) if "num_hidden_layers" not in cfg else cfg
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        arch = {k: cfg.get(k) for k in FINGERPRINT_FIELDS}
        arch.update(head_dim=head_dim, rope_theta=_rope_theta(cfg),
                    num_key_value_heads=int(cfg.get("num_key_value_heads") or heads))
        digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
        return cls(architecture=str(cfg.get("model_type", "")),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=arch["num_key_value_heads"], head_dim=head_dim,
                   rope_theta=arch["rope_theta"], fingerprint=digest.hexdigest()[:16],
                   name=name or str(cfg.get("_name_or_path") or ""))

    @classmethod
    def of_directory(cls, model_dir: str | os.PathLike[str]) -> ModelIdentity:
        """The identity of the model in a local Hugging Face directory (its config.json)."""
        path = Path(model_dir) / "config.json"
        return cls.of(json.loads(path.read_text()), name=Path(model_dir).name)

    def describe(self) -> str:
        """E.g. '24 layers x 2 KV heads x head_dim 64 (qwen2, 14 query heads, RoPE theta
        1e+06, fingerprint ...)'."""
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim "
                f"{self.head_dim} ({self.architecture}, {self.num_heads} query heads, RoPE "
                f"theta {self.rope_theta:g}, fingerprint {self.fingerprint})")

    def differs(self, other: ModelIdentity) -> bool:
        """True when ``other`` is not the model this identity describes (name aside)."""
        return any(getattr(self, f.name) != getattr(other, f.name) for f in fields(self)
                   if f.name != "name")


@dataclass(frozen=True)
class SaapLayer:
    """One layer's routing on one device, ready for serving (batch norm folded)."""

    inv_freq: torch.Tensor
    """[R/2] fp32 RoPE frequencies (R rotated dimensions, R <= D)."""
    rope_scale: float
    """The model's RoPE output scale (``attention_scaling``; 1 for plain RoPE)."""
    key_mean: torch.Tensor
    """[H, D] fp32 mean subtracted from de-RoPEd keys before the nearest-centroid search."""
    centroids: torch.Tensor
    """[H, C, D] fp32 unit centroids."""
    w1_t: torch.Tensor
    """[H, D, F] fp32 first layer with the batch norm folded in (transposed)."""
    b1: torch.Tensor
    """[H, 1, F] fp32 its bias."""
    w2_t: torch.Tensor
    """[H, F, C] fp32 second layer (transposed)."""
    b2: torch.Tensor
    """[H, 1, C] fp32."""
    dense: bool
    """A layer the file marks dense (served with every bucket: full attention)."""

    @property
    def num_buckets(self) -> int:
        """C."""
        return int(self.centroids.shape[1])

    def assign(self, keys: torch.Tensor, positions: torch.Tensor, backend: str = "auto",
               chunk: int = 16384) -> torch.Tensor:
        """Bucket of each key: its nearest centroid by cosine after de-RoPE and centring.

        keys: [H, M, D] post-RoPE (any float dtype); positions: [M] int64 absolute
        positions. Returns [H, M] int64 in [0, C) (ties to the lower bucket). The search is
        :func:`vllm_retro.kernels.kmeans_assign` (``backend``: on the CPU 'auto' fuses the
        product and the argmax in C++), ``chunk`` keys at a time."""
        h, m, _ = keys.shape
        c = self.num_buckets
        out = torch.empty(h, m, dtype=torch.int64, device=keys.device)
        k_valid = torch.full((h,), c, dtype=torch.int64, device=keys.device)
        for s in range(0, m, chunk):
            x = derope(keys[:, s:s + chunk], positions[s:s + chunk], self.inv_freq,
                       self.rope_scale) - self.key_mean[:, None]
            n_valid = torch.full((h,), x.shape[1], dtype=torch.int64, device=keys.device)
            # |x| is the same for every centroid: the largest x . c is the largest cosine
            out[:, s:s + chunk] = kernels.kmeans_assign(x, self.centroids, n_valid, k_valid,
                                                        backend=backend)
        return out

    def bucket_scores(self, query: torch.Tensor, position: int) -> torch.Tensor:
        """Ranking of the buckets for one decode step: ``sum_g softmax(f_q(q_g))``.

        query: [H, G, D] post-RoPE queries of the newest token (at ``position``), G query
        heads per KV head. Returns [H, C] fp32."""
        pos = torch.full((1,), position, dtype=torch.int64, device=query.device)
        return self.bucket_scores_batch(query[None], pos)[0]

    def bucket_scores_batch(self, query: torch.Tensor, positions: torch.Tensor
                            ) -> torch.Tensor:
        """:meth:`bucket_scores` of B requests' newest tokens at once (one classifier pass
        per KV head for the batch): query [B, H, G, D] post-RoPE, positions [B] int64.
        Returns [B, H, C] fp32."""
        b, h, g, d = query.shape
        # [H, G, B, D]: each request's queries rotated back at its own position
        x = derope(query.permute(1, 2, 0, 3), positions, self.inv_freq, self.rope_scale)
        hidden = torch.relu(torch.baddbmm(self.b1, x.reshape(h, g * b, d), self.w1_t))
        logits = torch.baddbmm(self.b2, hidden, self.w2_t)  # [H, G * B, C]
        probs = torch.softmax(logits, dim=-1).reshape(h, g, b, -1)
        return probs.sum(1).transpose(0, 1)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [M, R] fp32, of the half-split RoPE at ``positions`` [M]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         scale: float = 1.0) -> torch.Tensor:
    """Apply the half-split ('NeoX', ``rotate_half``) RoPE: x [..., M, D] at positions [M];
    the first R = 2 * len(inv_freq) dimensions rotate, the rest pass. Returns fp32."""
    cos, sin = rope_angles(positions, inv_freq)
    r = cos.shape[-1]
    xf = x.float()
    rot = xf[..., :r]
    out = (rot * cos + _rotate_half(rot) * sin) * scale
    return torch.cat([out, xf[..., r:]], dim=-1) if r < x.shape[-1] else out


def derope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           scale: float = 1.0) -> torch.Tensor:
    """Undo :func:`rope`: x [..., M, D] post-RoPE at positions [M] -> the pre-RoPE vectors
    (fp32; the inverse rotation ``x cos - rotate_half(x) sin``, divided by ``scale``)."""
    cos, sin = rope_angles(positions, inv_freq)
    r = cos.shape[-1]
    xf = x.float()
    rot = xf[..., :r]
    out = (rot * cos - _rotate_half(rot) * sin) / scale
    return torch.cat([out, xf[..., r:]], dim=-1) if r < x.shape[-1] else out


@dataclass
class SaapModel:
    """A SAAP file in memory: see the module docstring and :data:`TENSORS`."""

    identity: ModelIdentity
    tensors: dict[str, torch.Tensor]
    dense_layers: tuple[int, ...] = ()
    """Layers served with every bucket (full attention), as the paper does for layer 0."""
    rope_scale: float = 1.0
    bn_eps: float = 1e-5
    training: dict[str, Any] = field(default_factory=dict)
    """The calibration settings (text, tokens, buckets, steps, ...)."""
    quality: dict[str, Any] = field(default_factory=dict)
    """Held-out measurements written by calibration (attention mass recall, ...)."""
    path: str = ""
    _layers: dict[tuple[int, str], SaapLayer] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_buckets(self) -> int:
        """C: buckets per (layer, KV head)."""
        return int(self.tensors["centroids"].shape[2])

    @property
    def hidden(self) -> int:
        """F: the classifier's hidden width."""
        return int(self.tensors["w1"].shape[2])

    def check_shapes(self) -> None:
        """Raise :class:`SaapFileError` unless every tensor has the shape the identity, C and
        F imply."""
        idn, c, f = self.identity, self.num_buckets, self.hidden
        lh = (idn.num_layers, idn.num_kv_heads)
        d = idn.head_dim
        want = {"key_mean": (*lh, d), "centroids": (*lh, c, d), "w1": (*lh, f, d),
                "b1": (*lh, f), "bn_weight": (*lh, f), "bn_bias": (*lh, f), "bn_mean": (*lh, f),
                "bn_var": (*lh, f), "w2": (*lh, c, f), "b2": (*lh, c)}
        for name in TENSORS:
            t = self.tensors.get(name)
            if t is None:
                raise SaapFileError(f"saap file {self.path or '<memory>'}: tensor {name!r} is "
                                    "missing; rerun vllm-retro calibrate")
            shape = tuple(t.shape)
            ok = (shape == want[name] if name in want else
                  len(shape) == 1 and 0 < 2 * shape[0] <= d)
            if not ok:
                raise SaapFileError(f"saap file {self.path or '<memory>'}: tensor {name!r} has "
                                    f"shape {shape}, expected {want.get(name, f'[<= {d // 2}]')}"
                                    f" for {idn.describe()}")
        bad = [i for i in self.dense_layers if not 0 <= i < idn.num_layers]
        if bad:
            raise SaapFileError(f"saap file {self.path or '<memory>'}: dense layers {bad} are "
                                f"out of range for {idn.num_layers} layers")

    def check_model(self, identity: ModelIdentity) -> None:
        """Raise :class:`SaapFileError` (one line) unless this file was trained for the model
        ``identity`` describes."""
        if self.identity.differs(identity):
            raise SaapFileError(
                f"saap file {self.path or '<memory>'} was trained for "
                f"{self.identity.describe()}{_named(self.identity)}; the model served is "
                f"{identity.describe()}{_named(identity)}: run `vllm-retro calibrate MODEL "
                "--out FILE` for this model")

    def check_serving(self, num_kv_heads: int | None, head_dim: int,
                      probes: int | None = None) -> None:
        """Raise :class:`SaapFileError` / :class:`ConfigError` unless an index of
        ``num_kv_heads`` (None: not checked) x ``head_dim`` can be served with this file and
        ``probes`` buckets per query."""
        idn = self.identity
        heads = idn.num_kv_heads if num_kv_heads is None else num_kv_heads
        if head_dim != idn.head_dim or heads != idn.num_kv_heads:
            shown = "" if num_kv_heads is None else f"{num_kv_heads} KV heads x "
            raise SaapFileError(
                f"saap file {self.path or '<memory>'} was trained for {idn.describe()}; this "
                f"layer has {shown}head_dim {head_dim}"
                + (" (tensor parallelism is not supported with index='saap')"
                   if head_dim == idn.head_dim and heads < idn.num_kv_heads else ""))
        if probes is not None and probes > self.num_buckets:
            raise ConfigError(f"retro config: saap_probes={probes!r} is invalid; accepted: an "
                              f"integer in [1, {self.num_buckets}] (the buckets of saap file "
                              f"{self.path or '<memory>'})")

    def layer(self, index: int, device: torch.device | str) -> SaapLayer:
        """Layer ``index``'s routing on ``device`` (built once per device, then shared by
        every request)."""
        dev = torch.device(device)
        key = (index, str(dev))
        with self._lock:
            got = self._layers.get(key)
            if got is None:
                got = self._layers[key] = self._make_layer(index, dev)
        return got

    def _make_layer(self, i: int, dev: torch.device) -> SaapLayer:
        if not 0 <= i < self.identity.num_layers:
            raise SaapFileError(f"saap file {self.path or '<memory>'}: layer {i} is out of range"
                                f" for {self.identity.describe()}")
        t = {k: (v if k == "inv_freq" else v[i]).to(dev, torch.float32)
             for k, v in self.tensors.items()}  # this layer's [H, ...] slices
        # eval-mode batch norm: y = (x - mean) / sqrt(var + eps) * weight + bias, per unit
        gain = t["bn_weight"] / torch.sqrt(t["bn_var"] + self.bn_eps)  # [H, F]
        w1 = t["w1"] * gain[..., None]  # [H, F, D]
        b1 = (t["b1"] - t["bn_mean"]) * gain + t["bn_bias"]
        return SaapLayer(
            inv_freq=t["inv_freq"], rope_scale=self.rope_scale, key_mean=t["key_mean"],
            centroids=t["centroids"].contiguous(), w1_t=w1.transpose(1, 2).contiguous(),
            b1=b1[:, None, :].contiguous(), w2_t=t["w2"].transpose(1, 2).contiguous(),
            b2=t["b2"][:, None, :].contiguous(), dense=i in self.dense_layers)

    # ------------------------------------------------------------------ file
    def to_payload(self) -> dict[str, Any]:
        """The dict :meth:`save` writes (plain types and tensors only)."""
        meta = {"identity": {f.name: getattr(self.identity, f.name)
                             for f in fields(self.identity)},
                "dense_layers": list(self.dense_layers), "rope_scale": self.rope_scale,
                "bn_eps": self.bn_eps, "training": self.training, "quality": self.quality}
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                "meta": json.dumps(meta, sort_keys=True),
                "tensors": {k: self.tensors[k].detach().float().cpu().contiguous()
                            for k in TENSORS}}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the file atomically (a temporary file renamed over ``path``)."""
        self.check_shapes()
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(self.to_payload(), tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.path = str(path)

    @classmethod
    def from_payload(cls, payload: Any, path: str = "") -> SaapModel:
        """Rebuild from :meth:`to_payload`'s dict, checking format, version and shapes."""
        where = f"saap file {path or '<memory>'}"
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise SaapFileError(f"{where} is not a SAAP file (no {FORMAT_NAME!r} header); "
                                "write one with `vllm-retro calibrate MODEL --out FILE`")
        version = payload.get("version")
        if version != FORMAT_VERSION:
            raise SaapFileError(f"{where} has format version {version!r}; this vllm-retro "
                                f"reads version {FORMAT_VERSION}: rerun vllm-retro calibrate")
        try:
            meta = json.loads(payload["meta"])
            identity = ModelIdentity(**meta["identity"])
            tensors = dict(payload["tensors"])
            model = cls(identity=identity, tensors=tensors,
                        dense_layers=tuple(int(i) for i in meta.get("dense_layers", ())),
                        rope_scale=float(meta.get("rope_scale", 1.0)),
                        bn_eps=float(meta.get("bn_eps", 1e-5)),
                        training=dict(meta.get("training", {})),
                        quality=dict(meta.get("quality", {})), path=path)
        except (KeyError, TypeError, ValueError) as exc:
            raise SaapFileError(f"{where} is damaged ({type(exc).__name__}: {exc}); rerun "
                                "vllm-retro calibrate") from None
        model.check_shapes()
        return model

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SaapModel:
        """Read and check a file (:class:`SaapFileError` if missing, unreadable, of another
        format or version, or inconsistent)."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise SaapFileError(f"saap file {path} does not exist; write it with "
                                "`vllm-retro calibrate MODEL --out FILE`")
        try:
            payload = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets one line
            raise SaapFileError(f"saap file {path} cannot be read ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}); is it a "
                                "file written by `vllm-retro calibrate`?") from None
        return cls.from_payload(payload, str(path))


def _named(identity: ModelIdentity) -> str:
    return f" [{identity.name}]" if identity.name else ""


_CACHE: dict[tuple[str, int, int], SaapModel] = {}
_CACHE_LOCK = threading.Lock()


def load_saap(path: str | os.PathLike[str], model: Any = None) -> SaapModel:
    """:meth:`SaapModel.load`, once per process for a given file (the same object while the
    file is unchanged), checked against ``model`` when given (a :class:`ModelIdentity`, a
    Hugging Face config object or the dict of a ``config.json``)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    with _CACHE_LOCK:
        got = _CACHE.get(key) if key is not None else None
        if got is None:
            got = SaapModel.load(path)
            if key is not None:
                _CACHE[key] = got
    if model is not None:
        got.check_model(model if isinstance(model, ModelIdentity) else ModelIdentity.of(model))
    return got


_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_number(name: str | int) -> int:
    """The decoder layer index in a vLLM attention layer name ('model.layers.7.self_attn.attn'
    -> 7); an int is returned as is. ValueError unless the name holds exactly one number."""
    if isinstance(name, int):
        return name
    found = _LAYER_NUMBER.findall(name)
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of attention layer {name!r}")
    return int(found[0])


def random_saap_model(identity: ModelIdentity, num_buckets: int, hidden: int,
                      generator: torch.Generator | None = None,
                      dense_layers: tuple[int, ...] = (), rope_theta: float | None = None,
                      rotary_dim: int | None = None) -> SaapModel:
    """A SAAP model with random centroids and classifiers (for tests and benchmarks, where
    only the routing's arithmetic and cost matter, not its quality)."""
    g = generator or torch.Generator().manual_seed(0)
    lh = (identity.num_layers, identity.num_kv_heads)
    d, c, f = identity.head_dim, num_buckets, hidden
    r = rotary_dim or d
    theta = rope_theta or identity.rope_theta

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    cent = torch.nn.functional.normalize(rnd(*lh, c, d), dim=-1)
    tensors = {
        "inv_freq": 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r),
        "key_mean": rnd(*lh, d, s=0.5), "centroids": cent,
        "w1": rnd(*lh, f, d, s=d ** -0.5), "b1": rnd(*lh, f, s=0.1),
        "bn_weight": 1 + rnd(*lh, f, s=0.1), "bn_bias": rnd(*lh, f, s=0.1),
        "bn_mean": rnd(*lh, f, s=0.1), "bn_var": rnd(*lh, f, s=0.1).abs() + 0.5,
        "w2": rnd(*lh, c, f, s=3 * f ** -0.5), "b2": rnd(*lh, c, s=0.1),
    }
    return SaapModel(identity=identity, tensors=tensors, dense_layers=dense_layers)
