"""The teacher registry and the teacher workers that score student samples.

Registry: every domain names a teacher (distill.domains: checkpoint, arch, replicas, and the
model preset of a flashtrain checkpoint that records none: a public-layout dir); teachers
are deduplicated by resolved checkpoint path, so two domains with one checkpoint share one
teacher. `resolve_teachers` checks every checkpoint exists before anything starts and names
the teacher that does not.

What a teacher sends per student token (docs/DESIGN.md, "Distillation", has the numbers):
  flashtrain teacher: its final hidden state [Dt] ("hidden"); the student side applies the
    teacher's LM head, shipped once per teacher and cached by the trainer;
  hf teacher: full-vocabulary log-probs [V] ("logprobs"), so the student never needs to know
    how a foreign architecture turns hidden states into logits.

Multiplexing (TeacherWorker): a worker hosts many teachers but keeps at most `max_resident` of
them loaded on its device, least recently used evicted first. An evicted teacher goes to the
CPU cache (at most `cpu_cache` teachers), beyond that it is dropped and re-read from disk.
On a GPU the CPU cache holds the module itself in host memory and swapping in is a host-to-
device copy; on a CPU-only machine the device is host memory already, so the cache holds the
teacher's state dict and swapping in rebuilds the module from it (no disk read, no checksum).
Every swap-in is timed (`swap_s`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conf.errors import ConfigError, UserError

ARCHS = ("flashtrain", "hf")


class TeacherError(UserError):
    """A teacher cannot be used: unloadable checkpoint or a vocabulary that is not the student's."""


@dataclass(frozen=True)
class TeacherSpec:
    key: str  # the resolved checkpoint path: one teacher per key
    name: str  # as the registry wrote it (for messages and metrics)
    arch: str
    replicas: int
    domains: tuple[str, ...]
    model: str | None = None  # flashtrain: the model preset, where the checkpoint records no config


def resolve_teachers(distill) -> tuple[dict[str, str], list[TeacherSpec]]:
    """distill.domains (restricted to distill.only) -> (domain -> teacher key, unique teachers).
    Raises TeacherError naming the teacher whose checkpoint is missing or incomplete."""
    from conf import GROUPS
    from trainer.checkpoint import CheckpointError, CheckpointManager
    from trainer.interop.convert import is_public_dir

    domains = dict(distill.domains)
    if distill.only:
        unknown = sorted(set(distill.only) - set(domains))
        if unknown:
            raise ConfigError(f"distill.only: {unknown} not in distill.domains")
        domains = {d: domains[d] for d in distill.only}
    if not domains:
        raise ConfigError("distill.domains: no domains")
    root = Path(distill.teacher_root).expanduser()
    by_key: dict[str, dict[str, Any]] = {}
    routes: dict[str, str] = {}
    for domain, t in sorted(domains.items()):
        if t.arch not in ARCHS:
            raise ConfigError(f"distill.domains.{domain}.arch={t.arch!r}: expected one of {', '.join(ARCHS)}")
        if t.replicas < 1:
            raise ConfigError(f"distill.domains.{domain}.replicas={t.replicas}: must be >= 1")
        path = Path(t.checkpoint).expanduser()
        path = path if path.is_absolute() else root / path
        where = f"teacher {t.checkpoint!r} (domain {domain})"
        if not path.exists():
            raise TeacherError(f"distill: {where} fails to load: no such checkpoint or directory {path}")
        if t.model is not None and t.model not in GROUPS["model"]:
            raise ConfigError(f"distill.domains.{domain}.model={t.model!r}: expected one of "
                              f"{', '.join(GROUPS['model'])}")
        if t.model is not None and t.arch == "hf":
            raise ConfigError(f"distill.domains.{domain}.model={t.model!r}: only for arch=flashtrain (an hf "
                              "teacher reads its config.json)")
        if t.arch == "flashtrain":
            if is_public_dir(path):  # the public DeepSeek-V4.1-Flash layout, imported as it loads
                resolved = path
            else:
                try:
                    resolved = CheckpointManager(path, 1, 0).resolve(str(path))
                except CheckpointError as e:
                    raise TeacherError(f"distill: {where} fails to load: "
                                       f"{str(e).split(': ', 1)[-1]}") from None
            if t.model is None and not (resolved / "trainer_state.pt").exists():
                raise TeacherError(f"distill: {where} fails to load: {resolved} records no model config; "
                                   "name its architecture with "
                                   f"distill.domains.{domain}.model={'|'.join(GROUPS['model'])}")
        else:
            resolved = path
            if not (path / "config.json").is_file():
                raise TeacherError(f"distill: {where} fails to load: no transformers config.json in {path}")
        key = str(resolved.resolve())
        entry = by_key.setdefault(key, {"name": t.checkpoint, "arch": t.arch, "replicas": t.replicas,
                                        "domains": [], "model": t.model})
        if entry["arch"] != t.arch:
            raise ConfigError(f"distill: checkpoint {key} is listed as both {entry['arch']} and {t.arch}")
        if entry["model"] != t.model:
            raise ConfigError(f"distill: checkpoint {key} is listed with model {entry['model']} and "
                              f"{t.model}")
        entry["replicas"] = max(entry["replicas"], t.replicas)
        entry["domains"].append(domain)
        routes[domain] = key
    specs = [TeacherSpec(k, e["name"], e["arch"], e["replicas"], tuple(e["domains"]), e["model"])
             for k, e in sorted(by_key.items())]
    return routes, specs


def place_teachers(specs: list[TeacherSpec], workers: int) -> list[list[TeacherSpec]]:
    """Teacher i goes to workers i, i+1, ... (replicas of them, mod `workers`)."""
    hosted: list[list[TeacherSpec]] = [[] for _ in range(workers)]
    for i, spec in enumerate(specs):
        for r in range(min(spec.replicas, workers)):
            hosted[(i + r) % workers].append(spec)
    return hosted


# ------------------------------------------------------------------------ loading one teacher
def _flashtrain_config(ckpt: Path):
    """The model config a flashtrain checkpoint was trained with (trainer_state.pt "config")."""
    from omegaconf import OmegaConf

    from conf.model import ModelConfig

    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
    if "config" not in state:
        raise ValueError("its trainer_state.pt holds no config")
    model = OmegaConf.create(state["config"]).get("model")
    if model is None:
        raise ValueError("its config has no model section")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))


def _teacher_model_config(spec: TeacherSpec):
    """A flashtrain teacher's model config: the one its checkpoint records, else its `model` preset
    (a public-layout directory or an imported checkpoint; resolve_teachers made sure it has one)."""
    ckpt = Path(spec.key)
    if (ckpt / "trainer_state.pt").exists():
        return _flashtrain_config(ckpt)
    from conf import GROUPS

    return GROUPS["model"][spec.model]()


def load_teacher(spec: TeacherSpec, tokenizer, student_vocab: int) -> torch.nn.Module:
    """The teacher's model on the CPU, eval mode. Raises TeacherError naming it when it fails to
    load or its vocabulary is not the student's."""
    import dataclasses
    from types import SimpleNamespace

    where = f"teacher {spec.name!r} (domains {', '.join(spec.domains)})"
    try:
        if spec.arch == "hf":
            from transformers import AutoConfig, AutoModelForCausalLM  # only for hf teachers
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # one bar per swap-in otherwise
            vocab = AutoConfig.from_pretrained(spec.key).vocab_size
            _check_vocab(where, vocab, student_vocab)
            _check_tokenizer(where, [Path(spec.key)], tokenizer)
            model = AutoModelForCausalLM.from_pretrained(spec.key, dtype=torch.float32)
        else:
            from trainer.checkpoint import load_model_weights
            from trainer.interop.convert import import_into_model, is_public_dir
            from trainer.pretrain import build_model

            ckpt = Path(spec.key)
            public = is_public_dir(ckpt)
            head = _head_rows(ckpt, public)
            _check_vocab(where, head, student_vocab)
            # a public dir ships its tokenizer itself; a checkpoint may, or its run dir
            _check_tokenizer(where, [ckpt] if public else [ckpt, ckpt.parent.parent], tokenizer)
            model_cfg = dataclasses.replace(_teacher_model_config(spec), vocab_size=head)
            model = build_model(SimpleNamespace(model=model_cfg), tokenizer)
            if public:  # config.json is checked against the model config first
                import_into_model(model, ckpt, log=lambda _: None)
            else:
                load_model_weights(model, ckpt)
    except TeacherError:
        raise
    except Exception as e:  # any reason a checkpoint cannot be read
        raise TeacherError(f"distill: {where} fails to load: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return model.eval()


def _head_rows(ckpt: Path, public: bool) -> int:
    import json

    from trainer.checkpoint import model_state

    if public:
        return int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    return int(model_state(ckpt)["head.weight"].shape[0])  # memory-mapped: only the shape is read


def _check_tokenizer(where: str, dirs: list[Path], tokenizer) -> None:
    """Same size is not same tokenizer: where the teacher ships a tokenizer.json (the first of
    `dirs` that has one), every token must have the student's id. A teacher without one can
    only be checked by vocabulary size."""
    from tokenizers import Tokenizer

    for d in dirs:
        path = d / "tokenizer.json"
        if path.is_file():
            theirs = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
            ours = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
            differ = sum(theirs.get(t) != i for t, i in ours.items()) + len(theirs.keys() - ours.keys())
            if differ:
                raise TeacherError(f"distill: {where} has another tokenizer ({path}: {differ} tokens differ "
                                   "from the student's): refused (a teacher must share the student's "
                                   "tokenizer)")
            return


def _check_vocab(where: str, vocab: int, student_vocab: int) -> None:
    if vocab != student_vocab:
        raise TeacherError(f"distill: {where} has a {vocab}-token vocabulary, the student {student_vocab}: "
                           "refused (a teacher must share the student's tokenizer)")


# ------------------------------------------------------------------------ the worker
class TeacherWorker:
    """Hosts `specs`; scores samples with the teacher of a key, swapping teachers in LRU order."""

    def __init__(self, specs: list[TeacherSpec], tokenizer_path: str, student_vocab: int, max_resident: int,
                 cpu_cache: int, threads: int = 1, device: str = "cpu", wire_dtype: str = "bfloat16"):
        from data.tokenizer import TextTokenizer

        if max_resident < 1 or cpu_cache < 0:
            raise ConfigError(f"distill: max_resident={max_resident} must be >= 1, "
                              f"cpu_cache={cpu_cache} >= 0")
        torch.set_num_threads(max(1, threads))
        self.specs = {s.key: s for s in specs}
        self.tokenizer = TextTokenizer.from_file(tokenizer_path)
        self.student_vocab, self.device = student_vocab, torch.device(device)
        self.max_resident, self.cpu_cache = max_resident, cpu_cache
        self.wire = getattr(torch, wire_dtype)
        self.resident: OrderedDict[str, torch.nn.Module] = OrderedDict()  # on self.device, LRU first
        self.cached: OrderedDict[str, Any] = OrderedDict()  # evicted: module (GPU hosts) or state dict (CPU)
        self.stats = {"swaps": 0, "swap_s": 0.0, "from_disk": 0, "from_cpu": 0}
        self.configs: dict[str, Any] = {}  # flashtrain teacher key -> its model config (read once)

    def check(self) -> list[str]:
        """Load every hosted teacher once (then LRU/cache as usual): the errors, by teacher."""
        errors = []
        for key in self.specs:
            try:
                self._acquire(key)
            except TeacherError as e:
                errors.append(str(e))
        return errors

    def _acquire(self, key: str) -> torch.nn.Module:
        if key in self.resident:
            self.resident.move_to_end(key)
            return self.resident[key]
        start = time.perf_counter()
        held = self.cached.pop(key, None)  # before evicting: an eviction may push it out of the cache
        while len(self.resident) >= self.max_resident:
            self._evict()
        if held is not None:
            model = self._restore(key, held)
            self.stats["from_cpu"] += 1
        else:
            model = load_teacher(self.specs[key], self.tokenizer, self.student_vocab).to(self.device)
            self.stats["from_disk"] += 1
        self.resident[key] = model
        self.stats["swaps"] += 1
        self.stats["swap_s"] += time.perf_counter() - start
        return model

    def _evict(self) -> None:
        key, model = self.resident.popitem(last=False)
        if self.cpu_cache == 0:
            return
        if self.device.type == "cuda":
            self.cached[key] = model.to("cpu")
        else:  # host memory is the device: keep the weights, drop the module
            self.cached[key] = {k: v for k, v in model.state_dict().items()}
        while len(self.cached) > self.cpu_cache:
            self.cached.popitem(last=False)

    def _restore(self, key: str, held: Any) -> torch.nn.Module:
        if isinstance(held, torch.nn.Module):
            return held.to(self.device, non_blocking=True)
        spec = self.specs[key]
        if spec.arch == "hf":
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.key),
                                                     dtype=torch.float32)
        else:
            import dataclasses
            from types import SimpleNamespace

            from trainer.pretrain import build_model

            if key not in self.configs:
                self.configs[key] = dataclasses.replace(_teacher_model_config(spec),
                                                        vocab_size=self.student_vocab)
            model = build_model(SimpleNamespace(model=self.configs[key]), self.tokenizer)
        model.load_state_dict(held)
        return model.eval().to(self.device)

    def resident_keys(self) -> list[str]:
        return list(self.resident)

    def head(self, key: str) -> torch.Tensor:
        """A flashtrain teacher's LM head [V, Dt] in the wire dtype."""
        return self._acquire(key).head.weight.detach().to("cpu", self.wire)

    @torch.no_grad()
    def score(self, key: str, seqs: list[tuple[list[int], list[int]]], with_head: bool = False):
        """(prompt ids, response ids) pairs -> (meta, outputs, head). outputs: per pair the
        teacher's view of each response token, hidden [R, Dt] (flashtrain) or log-probs [R, V]
        (hf), in the wire dtype; head: the LM head [V, Dt] when asked for (hidden only), else
        None. Three values so that the coordinator, which reads only `meta`, can hand the other
        two to the trainer as Ray object references (`num_returns=3`): they never pass through it."""
        swap_before = self.stats["swap_s"]
        model = self._acquire(key)
        start = time.perf_counter()
        spec = self.specs[key]
        rows = [p + r for p, r in seqs]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tokenizer.pad_id] * (width - len(r)) for r in rows], device=self.device)
        if spec.arch == "hf":
            lens = torch.tensor([len(r) for r in rows], device=self.device)
            attn = (torch.arange(width - 1, device=self.device)[None] < lens[:, None] - 1).long()
            out = torch.log_softmax(model(input_ids=ids[:, :-1], attention_mask=attn).logits.float(), dim=-1)
            kind = "logprobs"
        else:
            from model.runtime import AttentionRuntime

            out = model.hidden(ids[:, :-1],
                               AttentionRuntime(ids.shape[0], width - 1, self.device))  # [B, L-1, Dt]
            kind = "hidden"
        # position p - 1 + j predicts response token j
        outputs = [out[i, len(p) - 1:len(p) - 1 + len(r)].to("cpu", self.wire)
                   for i, (p, r) in enumerate(seqs)]
        meta = {"kind": kind, "tokens": sum(len(r) for _, r in seqs), "score_s": time.perf_counter() - start,
                "swap_s": self.stats["swap_s"] - swap_before, "resident": list(self.resident),
                "stats": dict(self.stats)}
        return meta, outputs, self.head(key) if with_head and kind == "hidden" else None
