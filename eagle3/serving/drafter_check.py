"""The drafter checker: a drafter folder's config and tensors judged against both engines' rules.

`check_drafter(config, tensors, target)` returns `Finding`s (error, warning, info), each naming
the engine it concerns; `errors(findings)` keeps the errors. Pure: the config.json dict and
the tensors under their on-disk names in, findings out; no file I/O, no engine import. The
rules themselves (layer ids, tensor names, shapes, versions) are eagle3/serving/engine_rules.py.
Export (eagle3/stages/s05_export/run.py), the drafter folder writer (eagle3/serving/drafter_io.py)
and `python -m eagle3.tools.diagnose inspect` all judge a drafter here, so what export refuses
is what inspect flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from eagle3.artifacts.vocab_map import target_ids
from eagle3.serving.engine_rules import (ARCHITECTURE, CAPTURE_TOPIC, D2T, EMBED_NAME, FC_NORM_PATTERN,
                                         LEGACY_FC_NORM_KEY, RULES, SGLANG, SGLANG_DEEPSEEK, SGLANG_DEEPSEEK_RULE_FROM,
                                         SGLANG_LLAMA_EAGLE3_ARCHS, SHAPE_FIRST_VERSIONS, T2D, VARIANT_KEYS, VLLM,
                                         VLLM_LLAMA_EAGLE3_ARCHS, VLLM_V2, WEIGHT_NAMES, captured_layers, config_int,
                                         expected_shapes, fc_norm_names, intended_layers, is_known_name,
                                         layer_range_problems, minimum_version, nested_layer_ids, rules_for,
                                         sglang_name, target_family, vllm_name)
from eagle3.target.info import default_aux_layers


@dataclass(frozen=True)
class Finding:
    """One judgement about a drafter. `level`: error (fails or silently misbehaves in
    `engine`), warning (works, but worth fixing), info."""

    level: str  # "error" | "warning" | "info"
    engine: str  # "vllm" | "sglang" | "both" | "pipeline"
    topic: str
    message: str

    def line(self) -> str:
        return f"{self.level.upper():7s} [{self.engine}] {self.topic}: {self.message}"


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


@dataclass(frozen=True)
class TargetFacts:
    """What the checks need to know about the target (from eagle3.target.info.TargetInfo)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    family: str
    source: str = "target"

    @classmethod
    def from_info(cls, info) -> "TargetFacts":
        return cls(info.num_layers, info.hidden_size, info.vocab_size, info.max_position_embeddings,
                   target_family(info.architecture, info.text_config.get("model_type", info.model_type)),
                   info.source)


def d2t_summary(d2t: torch.Tensor, vocab_size: int | None) -> dict[str, Any]:
    """Sanity of a d2t: target ids `i + d2t[i]` unique, ascending, in range."""
    ids = target_ids(d2t)
    out: dict[str, Any] = {"size": int(d2t.numel()), "dtype": str(d2t.dtype).replace("torch.", "")}
    if ids.numel() == 0:
        return {**out, "duplicates": 0, "ascending": True, "out_of_range": 0}
    out["duplicates"] = int(ids.numel() - torch.unique(ids).numel())
    out["ascending"] = bool((ids[1:] > ids[:-1]).all())
    out["min_target_id"], out["max_target_id"] = int(ids.min()), int(ids.max())
    lo_bad = int((ids < 0).sum())
    hi_bad = int((ids >= vocab_size).sum()) if vocab_size else 0
    out["out_of_range"] = lo_bad + hi_bad
    out["identity"] = bool((d2t == 0).all())
    return out


def check_drafter(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                  target: TargetFacts | None = None, *, pipeline_format: bool = True) -> list[Finding]:
    """Judge a drafter (config.json dict + tensors under their on-disk names) against
    both engines' rules and, when given, the target. `pipeline_format`: also hold it to
    this pipeline's own format (bf16, explicit head_dim, ascending d2t, t2d present)."""
    c = _Check(config, tensors, target, pipeline_format)
    if c.config_keys():  # the rest needs the sizes
        c.tensor_names()
        c.shapes()
        c.aux_count()
        c.fc_norm()
        c.vocab_mapping()
    c.layer_ids()
    c.against_target()
    return c.findings


class _Check:
    """The sections of `check_drafter`, sharing what earlier sections worked out."""

    def __init__(self, config, tensors, target, pipeline_format):
        self.cfg, self.t, self.target, self.strict = config, tensors, target, pipeline_format
        self.findings: list[Finding] = []
        self.H = config_int(config, "hidden_size")
        self.V = config_int(config, "vocab_size")
        self.Vd = config_int(config, "draft_vocab_size") or self.V
        self.Ht = config_int(config, "target_hidden_size") or self.H
        self.vllm_loaded: dict[str, str] = {}  # canonical name -> on-disk name, per engine
        self.sgl_loaded: dict[str, str] = {}
        self.num_aux: int | None = None

    def add(self, level: str, engine: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, engine, topic, message))

    @property
    def loaded(self) -> dict[str, str]:
        return {**self.sgl_loaded, **self.vllm_loaded}

    def config_keys(self) -> bool:
        cfg, add = self.cfg, self.add
        archs = list(cfg.get("architectures") or [])
        arch = archs[0] if archs else None
        if arch is None:
            add("error", "both", "config", "no `architectures`; write [\"LlamaForCausalLMEagle3\"]")
        else:
            vllm_arch = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
            if vllm_arch not in VLLM_LLAMA_EAGLE3_ARCHS:
                add("error", "vllm", "config", f"architecture {arch!r} (vLLM resolves it to {vllm_arch!r}) is not "
                    f"vLLM's Llama EAGLE-3 drafter; this format needs {ARCHITECTURE!r}")
            if arch not in SGLANG_LLAMA_EAGLE3_ARCHS:
                add("error", "sglang", "config", f"architecture {arch!r}: SGLang's llama_eagle3.py registers only "
                    f"{ARCHITECTURE!r}")
        if cfg.get("model_type") != "llama":
            add("error", "both", "config", f"model_type = {cfg.get('model_type')!r}; both engines build the "
                f"config with transformers' AutoConfig, which needs \"llama\" for this architecture")
        nl = config_int(cfg, "num_hidden_layers")
        if nl != 1:
            add("error", "pipeline", "config", f"num_hidden_layers = {nl}; this format is one decoder layer "
                f"(`midlayer`), and the engines would expect tensors for {nl} layers")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            add("error", "both", "config", f"hidden_act = {act!r}; the drafter's MLP is SiLU-gated")
        for key in VARIANT_KEYS:
            if cfg.get(key):
                add("error", "both", "config", f"{key} = {cfg[key]!r}: vLLM's llama_eagle3 honours it, SGLang's "
                    f"(and this pipeline's model) does not, so the engines would run different networks")
        if cfg.get("tie_word_embeddings"):
            add("error", "sglang", "config", "tie_word_embeddings is true: SGLang then uses embed_tokens (the "
                "target's full-vocab embedding) as lm_head and ignores this drafter's lm_head and d2t")

        H, nh = self.H, config_int(cfg, "num_attention_heads")
        if not H or not nh or self.V is None:
            add("error", "both", "config", "hidden_size, num_attention_heads and vocab_size (the target's "
                "vocabulary) must be set")
            return False
        if config_int(cfg, "draft_vocab_size") is None:
            add("warning", "both", "config", f"no draft_vocab_size: both engines take vocab_size ({self.V}) and "
                f"SGLang loads the target's lm_head instead of this drafter's")
        if config_int(cfg, "head_dim") is None:
            implied = H // nh
            q = next((t for n, t in self.t.items() if n.endswith("self_attn.q_proj.weight")), None)
            actual = q.shape[0] // nh if q is not None and q.shape[0] % nh == 0 else None
            if actual is not None and actual != implied:
                add("error", "both", "config", f"no head_dim, so both engines use hidden_size / "
                    f"num_attention_heads = {implied}, but q_proj has {q.shape[0]} rows = {nh} heads x {actual}; "
                    f"write \"head_dim\": {actual}")
            elif self.strict:
                add("warning", "pipeline", "config", f"no explicit head_dim (engines use {H} / {nh} = {implied}); "
                    f"this format writes it")
        return True

    def tensor_names(self) -> None:
        add = self.add
        vllm_rejected: list[str] = []
        for raw in self.t:
            status, canon = vllm_name(raw)
            if status == "reject":
                vllm_rejected.append(raw)
            elif status == "load" and canon:
                self.vllm_loaded[canon] = raw
            elif status == "ignore":
                add("info", "vllm", "tensors", f"{raw!r} is ignored by vLLM")
            status, canon = sglang_name(raw)
            if status == "ignore":
                layer0 = raw.startswith(("layers.", "model.layers."))
                add("error" if layer0 or raw.endswith("lm_head.weight") else "warning", "sglang", "tensors",
                    f"{raw!r} is ignored silently by SGLang" + (" (it only knows `midlayer.*`)" if layer0 else ""))
            elif status == "load" and canon:
                self.sgl_loaded[canon] = raw
            if self.strict and not is_known_name(raw):
                add("warning", "pipeline", "tensors", f"{raw!r} is not a name of this format (convention 6)")
        if vllm_rejected:
            prefixed = any(r.startswith("model.") for r in vllm_rejected)
            shown = ", ".join(repr(r) for r in vllm_rejected[:4]) + (", ..." if len(vllm_rejected) > 4 else "")
            add("error", "vllm", "tensors", f"{len(vllm_rejected)} tensor(s) are no parameter of vLLM's drafter "
                f"({shown}): loading raises ValueError"
                + (" (vLLM prepends \"model.\" itself; store names unprefixed)" if prefixed else ""))
        for engine, loaded in ((VLLM, self.vllm_loaded), (SGLANG, self.sgl_loaded)):
            if engine == VLLM and vllm_rejected:
                continue  # vLLM fails on the rejected names before anything could stay uninitialised
            missing = [n for n in WEIGHT_NAMES if n not in loaded]
            if "lm_head.weight" in missing and not config_int(self.cfg, "draft_vocab_size"):
                missing.remove("lm_head.weight")  # both engines then use the target's lm_head
            if missing:
                add("error", engine, "tensors", f"no tensor loads into {missing}: the engine runs with those "
                    f"weights uninitialised, without an error")
        if EMBED_NAME in self.loaded:
            add("info", "both", "tensors", "embed_tokens is included: the engines use it instead of the target's "
                "embedding (vLLM shares the target's only when identical)")

    def shapes(self) -> None:
        fc_raw = self.loaded.get("fc.weight")
        fc = self.t[fc_raw] if fc_raw else None
        if fc is not None and fc.dim() == 2 and fc.shape[1] % self.Ht == 0:
            self.num_aux = fc.shape[1] // self.Ht
        elif fc is not None:
            self.add("error", "both", "tensors", f"fc.weight has shape {tuple(fc.shape)}; its input width must be "
                     f"a multiple of target_hidden_size = {self.Ht}")
        want = expected_shapes(self.cfg, self.num_aux or 3)
        for canon, raw in self.loaded.items():
            if canon in want and tuple(self.t[raw].shape) != want[canon]:
                self.add("error", "both", "tensors", f"{raw} has shape {tuple(self.t[raw].shape)}, config.json "
                         f"implies {want[canon]}")
        if self.strict:
            dtypes = sorted({str(self.t[r].dtype).replace("torch.", "") for c, r in self.loaded.items()
                             if c not in (D2T, T2D)})
            if dtypes and dtypes != ["bfloat16"]:
                self.add("warning", "pipeline", "tensors", f"weights are {dtypes}, this format writes bfloat16 "
                         f"(the engines cast to the serving dtype)")

    def aux_count(self) -> None:
        ec = self.cfg.get("eagle_config") if isinstance(self.cfg.get("eagle_config"), Mapping) else {}
        if ec.get("use_aux_hidden_state") is False:
            self.add("error", "both", "layers", "eagle_config.use_aux_hidden_state is false: vLLM then drops fc and "
                     "feeds the drafter one hidden state; this is not an EAGLE-3 drafter")
        if self.num_aux is None:
            return
        # Both engines size fc alike: vLLM 0.32's llama_eagle3, and SGLang's from 0.5.12 on (read
        # in the 0.5.12, 0.5.13, 0.5.16 and 0.5.23 wheels), so four aux layers serve in both.
        nested = nested_layer_ids(self.cfg)
        served_aux = config_int(self.cfg, "num_aux_hidden_states") or (len(nested) if nested else 3)
        if served_aux != self.num_aux:
            self.add("error", "both", "layers", f"fc fuses {self.num_aux} aux states but the engines size fc for "
                     f"{served_aux} (num_aux_hidden_states, else the nested id count, else 3)")

    def fc_norm(self) -> None:
        """EAGLE 3.1's norms (module doc): the config keys against the `fc_norm.{i}` tensors."""
        cfg, add = self.cfg, self.add
        on, legacy = bool(cfg.get("fc_norm")), bool(cfg.get(LEGACY_FC_NORM_KEY))
        present = sorted({int(m.group(1)) for canon in self.loaded if (m := FC_NORM_PATTERN.fullmatch(canon))})
        n = self.num_aux or 3
        if legacy and not on:
            add("error", "vllm", "config", f"{LEGACY_FC_NORM_KEY} = true (the legacy spelling of fc_norm): "
                f"SGLang reads it, vLLM reads only `fc_norm` and runs without the aux-layer norms; write "
                f"\"fc_norm\": true")
        if (on or legacy) and present != list(range(n)):
            missing = [name for i, name in enumerate(fc_norm_names(n)) if i not in present]
            extra = [i for i in present if i >= n]
            if missing:
                add("error", "both", "tensors", f"fc_norm is on but {missing} are missing: the engine keeps those "
                    f"norms at their initial weight (ones), not as trained, without an error")
            if extra:
                add("error", "both", "tensors", f"fc_norm.{extra} beyond the {n} aux layers fc fuses: vLLM has no "
                    f"such parameter and loading raises; SGLang drops them")
        elif present and not (on or legacy):
            add("error", "both", "config", f"the file holds {len(present)} fc_norm tensor(s) but config.json does "
                f"not set \"fc_norm\": true: vLLM then has no such parameter and loading raises, SGLang drops "
                f"them silently and runs without the trained norms")
        if on or legacy or cfg.get("norm_output"):
            first = SHAPE_FIRST_VERSIONS["eagle3.1"]
            add("info", "both", "shape", f"EAGLE 3.1 (fc_norm {on or legacy}, norm_output "
                f"{bool(cfg.get('norm_output'))}): served by vLLM >= {first['vllm']} and SGLang >= {first['sglang']}")

    def vocab_mapping(self) -> None:
        add, V, Vd = self.add, self.V, self.Vd
        d2t_raw = self.loaded.get(D2T)
        if d2t_raw is None:
            if Vd != V:
                add("error", "both", "d2t", f"no d2t while draft_vocab_size {Vd} != vocab_size {V}: vLLM maps "
                    f"draft id i to target id i (identity) and SGLang has no hot-token map, silently")
            return
        d2t = self.t[d2t_raw]
        if Vd == V:
            add("error", "vllm", "d2t", f"d2t is present while draft_vocab_size == vocab_size ({V}): vLLM then "
                f"has no draft_id_to_target_id parameter and loading raises; drop d2t")
        s = d2t_summary(d2t, V)
        if d2t.dtype != torch.int64:
            add("error" if d2t.dtype.is_floating_point else "warning", "both", "d2t",
                f"d2t is {s['dtype']}; engines expect int64 offsets")
        if s["out_of_range"]:
            add("error", "both", "d2t", f"{s['out_of_range']} target id(s) i + d2t[i] outside [0, {V}): the "
                f"engines index out of bounds")
        if s["duplicates"]:
            add("error", "both", "d2t", f"{s['duplicates']} duplicate target id(s) among i + d2t[i]: two draft "
                f"rows map to one token and vLLM's scatter keeps only one of them")
        if not s["ascending"] and not s["duplicates"] and self.strict:
            add("warning", "pipeline", "d2t", "target ids i + d2t[i] are not ascending (convention 2 sorts them)")
        t2d_raw = self.loaded.get(T2D) or next((r for r in self.t if sglang_name(r)[1] == T2D), None)
        if t2d_raw is not None and not s["out_of_range"]:
            t2d = self.t[t2d_raw]
            ids = target_ids(d2t)
            if t2d.shape != (V,) or t2d.dtype != torch.bool or int(t2d.sum()) != d2t.numel() \
                    or not bool(t2d[ids].all()):
                add("warning", "pipeline", "t2d", "t2d disagrees with d2t (both engines ignore t2d, but this "
                    "pipeline's loader and fine-tuning read it)")
        elif t2d_raw is None and self.strict:
            add("info", "pipeline", "t2d", "no t2d (both engines ignore it; this format writes it)")

    def layer_ids(self) -> None:
        cfg, target = self.cfg, self.target
        layers, where = intended_layers(cfg, target.family if target else None)
        N = target.num_layers if target else None
        if layers is not None:
            for p in layer_range_problems(layers, N):
                self.add("error", "both", "layers", f"{where} = {layers}: {p}")
        ref = layers if layers is not None else (default_aux_layers(N) if N else None)
        for rule in rules_for(target.family if target else None):
            got = captured_layers(rule, cfg, N)
            if got is None or ref is None or got == ref:
                continue
            # Without a target we cannot tell whether the DeepSeek rule applies at all; on a
            # DeepSeek/Kimi target the "+ 1 always" rule is that of SGLang releases below the
            # supported minimum (before PR #25454): a warning, so a K2.5 drafter's [2, 30, 58] passes.
            old_sglang = target is not None and target.family == "deepseek" and rule == SGLANG
            if target is None:
                level = "warning" if rule == SGLANG_DEEPSEEK else "error"
            else:
                level = "warning" if old_sglang else "error"
            label = "SGLang before PR #25454 (releases before 0.5.13)" if old_sglang else RULES[rule].split(":")[0]
            why = ""
            if rule == SGLANG_DEEPSEEK:
                why = (" (that rule adds one only when the first nested id is 1, i.e. the first layer is 2"
                       + ("; layer 1 needs nested id 0, which it never shifts" if ref and ref[0] == 1 else "") + ")")
            self.add(level, VLLM if rule in (VLLM, VLLM_V2) else SGLANG, CAPTURE_TOPIC,
                     f"{label} captures {got}, but the drafter was trained on {ref} ({where}){why}"
                     + ("" if target else "; pass --target-config to know whether this rule applies")
                     + (f"; serve with SGLang >= {SGLANG_DEEPSEEK_RULE_FROM} (the supported minimum, "
                        f"{minimum_version('sglang')}, is later)" if old_sglang else ""))
        if layers is None:
            self.add("warning", "both", "layers", "config.json names no aux layers; both engines use "
                     "[2, N//2, N-3] of the target, which must be what the drafter was trained on")
        elif cfg.get("eagle_aux_hidden_state_layer_ids") and nested_layer_ids(cfg) is None and target is None:
            # With a target, the comparison above already says whether SGLang's fallback matches.
            self.add("warning", "sglang", "layers", "only top-level ids: SGLang reads only eagle_config's and "
                     "falls back to [2, N//2, N-3]; write eagle_config.eagle_aux_hidden_state_layer_ids = ids - 1")
        elif not cfg.get("eagle_aux_hidden_state_layer_ids") and target is None:
            # With a target, the comparison above already says what V2's fallback captures.
            self.add("warning", "vllm", "layers", f"only nested eagle_config ids: vLLM's V2 model runner (the GPU "
                     f"default since 0.32) never reads them and captures [2, N//2, N-3] of the target, while V1 "
                     f"takes them as-is; write top-level eagle_aux_hidden_state_layer_ids = {layers}")

    def against_target(self) -> None:
        add, target = self.add, self.target
        mpe = config_int(self.cfg, "max_position_embeddings")
        if target is None:
            if mpe is None:
                add("warning", "both", "config", "no max_position_embeddings (engines default to 2048/8192)")
            return
        if mpe is None or mpe < target.max_position_embeddings:
            add("error", "sglang", "config", f"max_position_embeddings = {mpe} < the target's "
                f"{target.max_position_embeddings}: SGLang refuses a draft with a shorter context (unless "
                f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); write at least the target's")
            add("info", "vllm", "config", "vLLM 0.32 raises the draft's max_position_embeddings to the target's "
                "max_model_len itself (config/speculative.py)")
        if self.V is not None and self.V != target.vocab_size:
            add("error", "both", "config", f"vocab_size = {self.V}, the target's is {target.vocab_size}: vLLM "
                f"scatters draft logits into vocab_size columns and the target verifies {target.vocab_size}")
        if self.Ht is not None and self.Ht != target.hidden_size:
            add("error", "both", "config", f"target_hidden_size = {self.Ht} (hidden_size when absent) but the "
                f"target's hidden size is {target.hidden_size}: fc cannot read its aux states")
        if self.H is not None and self.H != target.hidden_size and EMBED_NAME not in self.loaded:
            add("error", "both", "config", f"hidden_size {self.H} != the target's {target.hidden_size} and no "
                f"embed_tokens: the engines share the target's embedding, of the wrong width")
