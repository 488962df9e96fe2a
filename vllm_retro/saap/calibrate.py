"""``vllm-retro calibrate [MODEL] --out FILE``: train SAAP's routing for a model, once.

1. **Text** (:mod:`~vllm_retro.saap.corpus`): ``--tokens`` tokens (default 16384) of the
   installed distributions' descriptions, or of ``--text FILE_OR_DIR``, cut into prompts of
   ``--prompt-tokens`` (4096); the last ``--holdout-prompts`` (1) are held out.
2. **Record** (:mod:`~vllm_retro.saap.record`): each prompt through the Hugging Face model,
   keeping every layer's de-RoPEd keys and the queries of ``--query-samples`` (512) random
   positions per prompt (at least 512 tokens in).
3. **Train** (:mod:`~vllm_retro.saap.train`), layer by layer: ``--buckets`` (256) centroids
   per KV head, the attention mass per bucket beyond ``--min-distance`` (64) tokens, the
   classifier (``--hidden`` 256, ``--steps`` 300 of Adam), and its held-out quality.
4. **Write** the file (:class:`~vllm_retro.index.saap_model.SaapModel`).

Everything done is kept in ``FILE.work/`` (a prompt's recording, a layer's training) until
the file is written: rerunning the same command after an interruption continues where it
stopped. Rerunning it with other settings is refused while that directory exists (delete it,
or pass ``--restart``).

Defaults and why (Qwen2.5-Coder-0.5B on a 2-core CPU; the paper's values in brackets):

- ``C`` = 256 buckets [1024, for 100K-500K-token contexts]: at the 4K-32K contexts served
  here that is 16-128 keys per bucket, and the ~12K training keys per head give ~50 per
  centroid. The paper's ``l / C`` = 32 / 1024 is ``saap_probes`` 8 here; serving defaults
  to 16, measured on held-out text (Qwen, ``l`` = 4 / 8 / 16 / 32 / 64: SAAP's buckets hold
  30 / 40 / 52 / 66 / 80% of the attention beyond the window, the nearest centroids' 17 /
  25 / 37 / 53 / 72%, the best buckets' 50 / 63 / 76 / 87 / 96%, reading 4 / 7 / 11 / 19 /
  33% of the keys; Qwen's attention beyond a 64-token window is a third of the total).
- hidden width 256 [1024]: the same held-out recall as 1024 on Qwen (layer 10: 0.385 vs
  0.386 of the long-range mass at ``l`` = 8), a quarter of the cost per decode step.
- ``--queries weighted``: every sampled query trains, weighted by its attention share beyond
  the window -- a soft form of the paper's long-range filter (appendix A: queries whose
  top-1 key is far), which keeps only 5-12% of Qwen's queries at 64 tokens and 1-5% at 256;
  measured on held-out text (layers 2 and 10, ``l`` = 8) it holds as much long-range mass as
  the hard filter on long-range queries (0.43 / 0.38 vs 0.44 / 0.38) and more of all the
  attention beyond the window as served (0.52 / 0.36 vs 0.48 / 0.31).
  ``--queries long-range`` is the paper's filter (``--min-query-distance``).
- pairs closer than 64 tokens (the default local window) are left out of the targets [the
  paper's dense window of 2047]; the first 4 tokens (sinks) too.
- layer 0 is served dense (every bucket), as in the paper (``--dense-layers``).
- 300 Adam steps of 256 queries at learning rate 1e-3 with cosine decay [40K steps of 1000
  at 1e-5]: minutes on a CPU; the training runs on one thread (several times faster than
  two on a busy 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import vllm_retro
from vllm_retro.index.saap_model import ModelIdentity, SaapModel
from vllm_retro.saap import corpus, train
from vllm_retro.saap.progress import ProgressBar

WORK_FORMAT = 1
"""Version of the work directory's layout (a different one is not resumed)."""

FIRST_QUERY = 512
"""Queries are sampled from this position on (enough keys beyond the window behind them)."""


class CalibrationError(ValueError):
    """A bad option, missing model or text, or a work directory of another calibration."""


def _fail(name: str, value: Any, accepted: str) -> None:
    raise CalibrationError(f"calibrate: --{name.replace('_', '-')}={value!r} is invalid; "
                           f"accepted: {accepted}")


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(name, value, f"an integer in [{lo}, {hi}]")


SETTING_HELP = {
    "buckets": "key centroids (buckets) per KV head",
    "hidden": "width of the routing classifier's hidden layer",
    "tokens": "tokens of text read in all (training and held out)",
    "prompt_tokens": "tokens per recorded prompt",
    "holdout_prompts": "prompts held out to measure the classifier's quality",
    "query_samples": "queries sampled per prompt",
    "queries": "'weighted' (every query, weighted by its long-range attention) or "
               "'long-range' (the paper's filter, see --min-query-distance)",
    "min_distance": "keys closer than this many tokens to the query are left out of the "
                    "targets (the local window serves them)",
    "min_query_distance": "with --queries long-range: keep queries whose top key is at "
                          "least this far",
    "sink_tokens": "first tokens left out of the targets (the sinks serve them)",
    "kmeans_iters": "k-means iterations per KV head",
    "steps": "Adam steps per layer",
    "batch_size": "queries per Adam step",
    "lr": "Adam learning rate (cosine decay to 0)",
    "eval_probes": "buckets per query when measuring held-out quality",
    "dtype": "'auto', 'float32' or 'bfloat16': the model's dtype while recording",
    "seed": "random seed (query samples, k-means, classifier initialisation)",
    "train_threads": "torch threads while training",
}
"""One line per training setting for ``--help`` (``dense_layers`` and ``text`` have theirs)."""


@dataclass(frozen=True)
class Settings:
    """Every calibration setting (see the module docstring for the defaults)."""

    buckets: int = 256
    hidden: int = 256
    tokens: int = 16384
    prompt_tokens: int = 4096
    holdout_prompts: int = 1
    query_samples: int = 512
    queries: str = "weighted"
    min_distance: int = 64
    min_query_distance: int = 64
    sink_tokens: int = 4
    kmeans_iters: int = 20
    steps: int = 300
    batch_size: int = 256
    lr: float = 1e-3
    dense_layers: tuple[int, ...] = (0,)
    eval_probes: int = 16
    dtype: str = "auto"
    seed: int = 0
    text: str | None = None
    train_threads: int = 1

    def __post_init__(self) -> None:
        _int("buckets", self.buckets, 2, 1 << 16)
        _int("hidden", self.hidden, 1, 1 << 16)
        _int("prompt_tokens", self.prompt_tokens, FIRST_QUERY + 64, 1 << 20)
        _int("tokens", self.tokens, 2 * self.prompt_tokens, 1 << 26)
        n = self.tokens // self.prompt_tokens
        _int("holdout_prompts", self.holdout_prompts, 1, n - 1)
        _int("query_samples", self.query_samples, 1, self.prompt_tokens - FIRST_QUERY)
        if self.queries not in ("weighted", "long-range"):
            _fail("queries", self.queries, "'weighted' or 'long-range'")
        _int("min_distance", self.min_distance, 1, self.prompt_tokens - FIRST_QUERY)
        _int("min_query_distance", self.min_query_distance, 0, self.prompt_tokens)
        _int("sink_tokens", self.sink_tokens, 0, 1024)
        _int("kmeans_iters", self.kmeans_iters, 1, 1000)
        _int("steps", self.steps, 1, 1 << 24)
        _int("batch_size", self.batch_size, 2, 1 << 16)
        ok = isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool)
        if not ok or not 0 < self.lr <= 1:
            _fail("lr", self.lr, "a number in (0, 1]")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0
               for i in self.dense_layers):
            _fail("dense_layers", list(self.dense_layers), "layer indices (integers >= 0)")
        _int("eval_probes", self.eval_probes, 1, self.buckets)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            _fail("dtype", self.dtype, "'auto', 'float32' or 'bfloat16'")
        _int("seed", self.seed, 0, 2 ** 63 - 1)
        _int("train_threads", self.train_threads, 1, 1024)

    @property
    def num_prompts(self) -> int:
        """Prompts read (training and held out)."""
        return self.tokens // self.prompt_tokens

    def torch_dtype(self) -> torch.dtype:
        """The dtype the model runs in: 'auto' is bfloat16 where the CPU has native bf16
        (AVX-512 BF16 / AMX: about 2x faster than fp32 on this project's machines), else
        float32."""
        if self.dtype == "auto":
            cpu = getattr(torch, "cpu", None)
            fast = cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
            return torch.bfloat16 if fast else torch.float32
        return getattr(torch, self.dtype)

    def plan(self) -> dict[str, Any]:
        """What a work directory must match to be resumed (not the thread count)."""
        d = dataclasses.asdict(self)
        d.pop("train_threads")
        d["dense_layers"] = list(self.dense_layers)
        return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``calibrate`` command's options."""
    s = Settings()
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="local Hugging Face model directory (default: the embedded "
                             "Qwen2.5-Coder-0.5B-Instruct, assembled on first use)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the SAAP file to write (serve with --retro-index saap "
                             "--retro-saap-file FILE)")
    parser.add_argument("--text", metavar="FILE_OR_DIR", default=None,
                        help="train on this text file, or every text file under this "
                             "directory (default: the descriptions of the Python "
                             "distributions installed here)")
    parser.add_argument("--restart", action="store_true",
                        help="discard FILE.work/ (an earlier run's progress) and start over")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep FILE.work/ after writing FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    g = parser.add_argument_group("training (defaults from the module's documentation)")
    for f in dataclasses.fields(Settings):
        if f.name == "text":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(s, f.name)
        if f.name == "dense_layers":
            g.add_argument(flag, type=int, nargs="*", default=list(default), metavar="LAYER",
                           help="layers served with every bucket (default: 0)")
        elif f.name in ("queries", "dtype"):
            g.add_argument(flag, default=default,
                           help=f"{SETTING_HELP[f.name]} (default: {default})")
        else:
            g.add_argument(flag, type=type(default), default=default,
                           metavar=type(default).__name__.upper(),
                           help=f"{SETTING_HELP[f.name]} (default: {default})")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` of parsed ``calibrate`` options."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)}
    values["dense_layers"] = tuple(values["dense_layers"])
    return Settings(**values)


# ---------------------------------------------------------------------- the work directory

def work_dir(out: Path) -> Path:
    """Where a calibration writing ``out`` keeps its progress."""
    return out.with_name(out.name + ".work")


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _open_plan(work: Path, plan: dict[str, Any], restart: bool) -> bool:
    """Create ``work`` with ``plan``, or check an existing one holds the same plan. Returns
    True when resuming."""
    path = work / "plan.json"
    if restart and work.exists():
        shutil.rmtree(work)
    if path.is_file():
        old = json.loads(path.read_text())
        if old == plan:
            return True
        diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
        raise CalibrationError(
            f"calibrate: {work} holds a calibration started with other settings "
            f"({', '.join(f'{k}: {old.get(k)!r} then, {plan.get(k)!r} now' for k in diff)}); "
            "rerun with the same options to continue it, or pass --restart")
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1, sort_keys=True))
    return False


def _text_hash(prompts: list[torch.Tensor]) -> str:
    return hashlib.sha256(torch.stack(prompts).numpy().tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------------- the command

def calibrate(model_dir: str | Path, out: str | Path, settings: Settings,
              restart: bool = False, keep_work: bool = False, progress: bool = True,
              log: Callable[[str], None] = print) -> SaapModel:
    """Train SAAP's routing for the model in ``model_dir`` and write it to ``out`` (see the
    module docstring). Resumes from ``out``'s work directory when one exists. Returns the
    model written."""
    t_start = time.perf_counter()
    model_dir, out = Path(model_dir).expanduser(), Path(out).expanduser()
    if not (model_dir / "config.json").is_file():
        raise CalibrationError(f"calibrate: {model_dir} is not a model directory (no "
                               "config.json)")
    if out.is_dir():
        raise CalibrationError(f"calibrate: --out {out} is a directory; give a file path")
    if not out.parent.is_dir():
        raise CalibrationError(f"calibrate: --out {out}: directory {out.parent} does not exist")
    identity = ModelIdentity.of_directory(model_dir)
    bad = [i for i in settings.dense_layers if i >= identity.num_layers]
    if bad:
        _fail("dense_layers", list(settings.dense_layers),
              f"layer indices below the model's {identity.num_layers} layers")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    docs = (corpus.path_documents(settings.text) if settings.text is not None
            else corpus.installed_documents())
    prompts = corpus.corpus_prompts(tokenizer, docs, settings.num_prompts,
                                    settings.prompt_tokens, settings.seed)
    work = work_dir(out)
    plan = {"work_format": WORK_FORMAT, "identity": dataclasses.asdict(identity),
            "settings": settings.plan(), "text_sha256": _text_hash(prompts)}
    resumed = _open_plan(work, plan, restart)
    log(f"vllm-retro calibrate: {identity.describe()}; {len(prompts)} prompts x "
        f"{settings.prompt_tokens} tokens of {corpus.describe_source(settings.text)} "
        f"({len(prompts) - settings.holdout_prompts} to train, {settings.holdout_prompts} "
        f"held out); {settings.buckets} buckets; work in {work}"
        + (" (resuming)" if resumed else ""))
    _record_all(model_dir, work, prompts, identity, settings, progress)
    _train_all(work, identity, settings, progress)
    model = _assemble(work, identity, settings, model_dir, plan["text_sha256"], len(docs))
    model.save(out)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    q = model.quality["mean"]
    t = model.training
    log(f"vllm-retro calibrate: wrote {out} ({out.stat().st_size / 2 ** 20:.1f} MiB) in "
        f"{time.perf_counter() - t_start:.0f} s (recording {t['record_seconds']:.0f} s, "
        f"training {t['train_seconds']:.0f} s in all runs). Held out, l = "
        f"{settings.eval_probes} of {settings.buckets} buckets, attention beyond the window held: "
        f"{q['served_saap']:.1%} by SAAP's classifier vs {q['served_kmeans']:.1%} by the "
        f"nearest centroids (best possible {q['served_oracle']:.1%}), reading "
        f"{q['selectivity']:.1%} of the keys. Serve with: vllm-retro serve {model_dir} "
        f"--retro-index saap --retro-saap-file {out}")
    return model


def _record_all(model_dir: Path, work: Path, prompts: list[torch.Tensor],
                identity: ModelIdentity, settings: Settings, progress: bool) -> None:
    """Record every prompt not yet in ``work`` (and the model's RoPE tables)."""
    from vllm_retro.saap import record

    todo = [i for i in range(len(prompts)) if not (work / f"prompt-{i:03d}.pt").is_file()]
    if not todo and (work / "rope.pt").is_file():
        return
    bar = ProgressBar("record", len(prompts) * identity.num_layers, "layer passes",
                      enabled=progress)
    bar.skip((len(prompts) - len(todo)) * identity.num_layers)
    bar.note("loading the model")
    model = record.load_causal_lm(model_dir, settings.torch_dtype())
    got = record.model_identity(model, identity.name)
    if got.differs(identity):
        raise CalibrationError(f"calibrate: the loaded model is {got.describe()}, its "
                               f"config.json says {identity.describe()}")
    rope = record.rope_tables(model)
    _save({"inv_freq": rope.inv_freq, "scale": rope.scale}, work / "rope.pt")
    gen = torch.Generator().manual_seed(settings.seed)
    span = settings.prompt_tokens - FIRST_QUERY
    samples = [torch.sort(torch.randperm(span, generator=gen)[:settings.query_samples]
                          + FIRST_QUERY).values for _ in prompts]
    for i in todo:
        bar.note(f"prompt {i + 1}/{len(prompts)}")
        t0 = time.perf_counter()
        q, k = record.record_prompt(model, prompts[i], samples[i], on_layer=bar.update)
        _save({"q": q, "k": k, "positions": samples[i],
               "seconds": time.perf_counter() - t0}, work / f"prompt-{i:03d}.pt")
    bar.close()
    del model


def _train_all(work: Path, identity: ModelIdentity, settings: Settings, progress: bool
               ) -> None:
    """Train every layer not yet in ``work``."""
    todo = [i for i in range(identity.num_layers) if not (work / f"layer-{i:03d}.pt").is_file()]
    if not todo:
        return
    n = settings.num_prompts
    data = [torch.load(work / f"prompt-{i:03d}.pt", weights_only=True, mmap=True)
            for i in range(n)]
    rope = torch.load(work / "rope.pt", weights_only=True)
    bar = ProgressBar("train ", identity.num_layers, "layers", enabled=progress)
    bar.skip(identity.num_layers - len(todo))
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.train_threads)
    try:
        for layer in todo:
            bar.note(f"layer {layer}")
            t0 = time.perf_counter()
            result = train_layer(layer, data, rope["inv_freq"], float(rope["scale"]),
                                 identity, settings)
            result["seconds"] = time.perf_counter() - t0
            _save(result, work / f"layer-{layer:03d}.pt")
            s = result["quality"]
            bar.note(f"layer {layer}: held {s['served_saap']:.0%} vs {s['served_kmeans']:.0%}"
                     " (nearest centroids)")
            bar.update()
    finally:
        torch.set_num_threads(threads)
    bar.close()


def train_layer(layer: int, data: list[dict[str, torch.Tensor]], inv_freq: torch.Tensor,
                rope_scale: float, identity: ModelIdentity, settings: Settings
                ) -> dict[str, Any]:
    """Train one layer from the recorded prompts (``data[i]``: ``q`` [L, Hq, S, D], ``k``
    [L, Hkv, T, D], ``positions`` [S]). Returns its file tensors ([Hkv, ...] each:
    ``key_mean``, ``centroids`` and the classifier's) and ``quality`` (held-out summary)."""
    s = settings
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + layer)
    hkv, hq, d = identity.num_kv_heads, identity.num_heads, identity.head_dim
    g = hq // hkv
    scale = d ** -0.5
    n_train = s.num_prompts - s.holdout_prompts
    keys = [p["k"][layer].float() for p in data]
    queries = [p["q"][layer].float() for p in data]
    positions = [p["positions"] for p in data]
    mean, cent = train.fit_centroids(torch.cat([k[:, s.sink_tokens:] for k in keys[:n_train]],
                                               dim=1), s.buckets, s.kmeans_iters, gen)
    pairs = train.Pairs(s.sink_tokens, s.min_distance, s.min_query_distance)
    per_prompt = []
    for k, q, pos in zip(keys, queries, positions, strict=True):
        buckets = train.assign_keys(k, mean, cent)
        per_prompt.append(train.bucket_mass(q, pos, k, buckets, s.buckets, inv_freq,
                                            rope_scale, scale, pairs))
    xs: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    ys: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    ws: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    for q, (mass, long_range, _, far) in zip(queries[:n_train], per_prompt[:n_train],
                                             strict=True):
        keep = mass.sum(-1) > 0.5
        if s.queries == "long-range":
            keep &= long_range
        for h in range(hkv):
            grp = slice(h * g, (h + 1) * g)
            sel = keep[grp]
            xs[h].append(q[grp][sel])
            ys[h].append(mass[grp][sel])
            ws[h].append(far[grp][sel])
    counts = torch.tensor([sum(len(x) for x in xs[h]) for h in range(hkv)])
    if int(counts.min()) == 0:
        raise CalibrationError(f"calibrate: layer {layer} has no training query (try a lower "
                               "--min-query-distance or --queries weighted)")
    width = int(counts.max())
    x = torch.zeros(hkv, width, d)
    y = torch.zeros(hkv, width, s.buckets)
    w = torch.zeros(hkv, width)
    for h in range(hkv):
        x[h, :counts[h]] = torch.cat(xs[h])
        y[h, :counts[h]] = torch.cat(ys[h])
        w[h, :counts[h]] = torch.cat(ws[h])
    clf = train.train_classifier(x, y, counts, s.hidden, s.steps, s.batch_size, s.lr, gen,
                                 w if s.queries == "weighted" else None)
    quality = train.QualityCounts()
    for q, (mass, long_range, share, far) in zip(queries[n_train:], per_prompt[n_train:],
                                                 strict=True):
        quality.add(train.evaluate(clf, cent, q, mass, share, long_range, far,
                                   s.eval_probes))
    return {"tensors": {"key_mean": mean, "centroids": cent, **clf.tensors()},
            "quality": quality.summary(), "train_queries": counts.tolist()}


def _assemble(work: Path, identity: ModelIdentity, settings: Settings, model_dir: Path,
              text_sha: str, documents: int) -> SaapModel:
    """The file's model from the work directory's layers."""
    layers = [torch.load(work / f"layer-{i:03d}.pt", weights_only=True)
              for i in range(identity.num_layers)]
    rope = torch.load(work / "rope.pt", weights_only=True)
    tensors = {"inv_freq": rope["inv_freq"]}
    for name in layers[0]["tensors"]:
        tensors[name] = torch.stack([lay["tensors"][name] for lay in layers])
    per_layer = [lay["quality"] for lay in layers]
    mean = {k: sum(q[k] for q in per_layer) / len(per_layer) for k in train.QUALITY_KEYS}
    sparse = [q for i, q in enumerate(per_layer) if i not in settings.dense_layers]
    training = {**settings.plan(), "text_source": corpus.describe_source(settings.text),
                "text_documents": documents, "text_sha256": text_sha,
                "model_dir": str(model_dir),
                "record_seconds": round(sum(
                    float(torch.load(work / f"prompt-{i:03d}.pt", weights_only=True,
                                     mmap=True).get("seconds", 0.0))
                    for i in range(settings.num_prompts)), 1),
                "train_seconds": round(sum(float(lay.get("seconds", 0.0)) for lay in layers),
                                       1),
                "vllm_retro": vllm_retro.__version__,
                "written": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "train_queries": [lay["train_queries"] for lay in layers]}
    quality = {"probes": settings.eval_probes, "layers": per_layer, "mean": mean,
               "mean_sparse_layers": {k: sum(q[k] for q in sparse) / max(len(sparse), 1)
                                      for k in train.QUALITY_KEYS}}
    return SaapModel(identity=identity, tensors=tensors,
                     dense_layers=tuple(sorted(set(settings.dense_layers))),
                     rope_scale=float(rope["scale"]), training=training, quality=quality)


def main(argv: list[str]) -> int:
    """``vllm-retro calibrate`` (``argv`` after the command name). Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="vllm-retro calibrate",
        description="Train SAAP's key centroids and query classifiers for a model (once per "
                    "model) and write them to --out, for --retro-index saap.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        model = args.model
        if model is None:
            from vllm_retro.models import ensure_qwen_coder

            model = ensure_qwen_coder()
        calibrate(model, args.out, settings, restart=args.restart, keep_work=args.keep_work,
                  progress=not args.quiet)
    except (CalibrationError, corpus.CorpusError) as exc:
        print(f"vllm-retro: error: {str(exc).removeprefix('calibrate: ')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nvllm-retro calibrate: interrupted; rerun the same command to continue",
              file=sys.stderr)
        return 130
    return 0
