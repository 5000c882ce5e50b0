"""The rules in force for one conversion: the policy table after the dtype overlay, the level and the
user's per-call op lists, plus forced precision by module path / node name / glob pattern, and the modules
the model's own keep-in-fp32 lists name (Hugging Face's _keep_in_fp32_modules: config.model_keep_fp32).

    PrecisionRules.build("O1", "float16", deny_ops=["gelu"], force_fp32=["encoder.layers.*.attn"])

Everything here is format-neutral: the fx and ONNX front ends ask it about (op, path, name) triples.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from amp_compiler.passes.policy.levels import ALL_MIXED, Level, level_of
from amp_compiler.passes.policy.names import check_known_names
from amp_compiler.passes.policy.op_aliases import ALIASES
from amp_compiler.passes.policy.op_policy import OpRule, device_kept_fp32, policy_for

# Families that keep_batchnorm_fp32 keeps in fp32 (Apex, MindSpore's O2), and that a level may keep fp32.
NORM_FAMILIES = ("norm",)
LOSS_FAMILIES = ("loss",)
# Norm kernels that take low-precision activations with fp32 weights and accumulate their statistics in
# fp32 (cuDNN/ATen "mixed" kernels, what Apex's O2 relies on): with keep_batchnorm_fp32 they keep fp32
# weights and statistics without casting the activations up and back down (which: the level's `mixed_norms`).
MIXED_KERNEL_NORMS = ALL_MIXED
MIXED_KERNEL_REASON = "fp32 weights and statistics on low-precision activations (mixed kernel, fp32 accumulation)"


AS_RECORDED_FAMILIES = ("subgraph",)   # calls of graphs converted on their own: no level re-classifies them


def _level_class(rule: OpRule, level: Level, keep_norm_fp32: bool) -> tuple[str, str]:
    """Class of one op at one level (levels.py says what each level re-classifies), with the reason to report."""
    if rule.op in level.mixed_norms and keep_norm_fp32:
        # A mixed kernel saves the cast pair around a norm whose input is already low; it is no reason to
        # cast an fp32 input down (a weight standardised by batch_norm stays fp32): an infer op, unless the
        # level lowers infer ops anyway.
        return ("allow" if "infer" in level.lowers else "infer"), f"{level.name}: {MIXED_KERNEL_REASON}"
    if rule.op_class not in level.lowers or rule.family in AS_RECORDED_FAMILIES:
        return rule.op_class, rule.reason
    if rule.family in LOSS_FAMILIES and level.keeps_losses_fp32:
        return "deny", f"{level.name}: losses stay fp32 ({rule.reason})"
    if rule.family in NORM_FAMILIES and keep_norm_fp32:
        return "deny", f"{level.name}: norms stay fp32 (keep_batchnorm_fp32=True)"
    return "allow", f"{level.name}: everything runs in low precision"


@dataclass
class PrecisionRules:
    level: str
    low_dtype: str                      # "float16" | "bfloat16"
    table: dict[str, tuple[str, str, str]]   # op -> (class, family, reason)
    force_fp32: tuple[str, ...] = ()
    force_low: tuple[str, ...] = ()
    keep_norm_fp32: bool = True
    matched_patterns: set[str] = field(default_factory=set)
    # op list entry -> its list, for names neither the table nor custom_ops knows: the graph must call them
    unlisted_ops: dict[str, str] = field(default_factory=dict)
    # (module name fragment, why) from the model's keep-in-fp32 lists: fp32 after the user's patterns, and
    # never "unmatched" (a list names modules of the whole family; this graph may hold none of them)
    model_fp32: tuple[tuple[str, str], ...] = ()

    @classmethod
    def build(cls, level: str, low_dtype: str, *, keep_norm_fp32: bool | None = None, devices=(),
              allow_ops=(), deny_ops=(), infer_ops=(), clear_ops=(),
              force_fp32=(), force_low=(), custom_ops=(), model_fp32=()) -> "PrecisionRules":
        spec = level_of(level)
        if keep_norm_fp32 is None:
            keep_norm_fp32 = spec.keep_norm_fp32
        table = {}
        for op, rule in policy_for(low_dtype).items():
            op_class, reason = _level_class(rule, spec, keep_norm_fp32)
            no_kernel = device_kept_fp32(op, low_dtype, devices)   # after the level: no level runs it low there
            if no_kernel is not None and op_class != "ignore":
                op_class, reason = "deny", no_kernel
            table[op] = (op_class, rule.family, reason)
        user_lists = {"allow": allow_ops, "deny": deny_ops, "infer": infer_ops, "clear": clear_ops}
        custom = set(string_tuple(custom_ops, "custom_ops"))
        seen: dict[str, str] = {}
        unlisted: dict[str, str] = {}
        for op_class, ops in user_lists.items():
            for name in string_tuple(ops, f"{op_class}_ops"):
                op = ALIASES.get(name, name)   # "truediv" acts on the node canonicalize names "div"
                if op in seen and seen[op] != op_class:
                    raise ValueError(f"op {op!r} is in both {seen[op]}_ops and {op_class}_ops: pick one")
                seen[op] = op_class
                if op not in table and op not in custom:
                    unlisted[op] = f"{op_class}_ops"
                family = table[op][1] if op in table else "user"
                table[op] = (op_class, family, f"user rule: {name} in {op_class}_ops")
        force_fp32, force_low = string_tuple(force_fp32, "force_fp32"), string_tuple(force_low, "force_low")
        both = set(force_fp32) & set(force_low)
        if both:
            raise ValueError(f"pattern(s) {sorted(both)} are in both force_fp32 and force_low: pick one")
        return cls(level, low_dtype, table, force_fp32, force_low, keep_norm_fp32, unlisted_ops=unlisted,
                   model_fp32=tuple(model_fp32))

    def classify(self, op: str) -> tuple[str, str, str]:
        """(class, family, reason); an op the table does not know is denied and reported as unknown."""
        if op in self.table:
            return self.table[op]
        return "deny", "unknown", f"unknown op {op!r}: kept fp32 (add it to allow_ops/infer_ops/clear_ops)"

    def norm_kept_fp32(self) -> str | None:
        """Why this conversion keeps a norm fp32 (a norm written by hand, painting/keep_norms_fp32.py), or None
        where it runs norms low: the rule rms_norm gets, the norm no kernel mixes (O1: the policy's deny, O2:
        keep_batchnorm_fp32; O3, keep_batchnorm_fp32=False at O2 or allow_ops=["rms_norm"]: low)."""
        op_class, _, reason = self.classify("rms_norm")
        return reason if op_class == "deny" else None

    def keeps_fp32_weights(self, op: str) -> bool:
        """Whether a low-precision `op` reads its weights in fp32 (a mixed norm kernel, where the level lowers norms)."""
        return self.keep_norm_fp32 and op in level_of(self.level).mixed_norms

    def forced(self, module_path: str, node_name: str) -> tuple[str, str] | None:
        """('fp32'|'low', rule text) when a force_* pattern names this node or a module around it, else
        ('fp32', why) when the model's keep-in-fp32 list names a module around it."""
        hits = []
        for precision, patterns in (("fp32", self.force_fp32), ("low", self.force_low)):
            for pattern in patterns:
                if pattern_matches(pattern, module_path, node_name):
                    hits.append((precision, pattern))
        if not hits:
            return next((("fp32", why) for fragment, why in self.model_fp32 if names_module(fragment, module_path)),
                        None)
        self.matched_patterns.update(p for _, p in hits)
        if len({p for p, _ in hits}) > 1:
            raise ValueError(f"node {node_name!r} (module {module_path!r}) is matched by force_fp32 and "
                             f"force_low patterns {[pat for _, pat in hits]}: make them disjoint")
        precision, pattern = hits[0]
        return precision, f"user rule: force_{precision} {pattern!r}"

    def check_op_names(self, graph_ops) -> None:
        """An op-list name the table does not know must be an op of this graph (a custom op), or a typo."""
        graph_ops = set(graph_ops)
        known = {*self.table, *ALIASES, *graph_ops} - set(self.unlisted_ops) | graph_ops
        for where in dict.fromkeys(self.unlisted_ops.values()):
            ops = [op for op, listed in self.unlisted_ops.items() if listed == where]
            check_known_names(where, ops, known, kind="ops of the policy table or of this graph",
                              hint=f"a custom op this graph does not call: declare it with custom_ops={ops!r}")

    def check_all_patterns_matched(self) -> None:
        unmatched = [p for p in (*self.force_fp32, *self.force_low) if p not in self.matched_patterns]
        if unmatched:
            raise ValueError(f"force_fp32/force_low pattern(s) {unmatched} matched no module path or node "
                             "name; explain(gm) lists both")


def string_tuple(value, what: str) -> tuple[str, ...]:
    """A user's list of names (op lists, force_* and fp8_keep patterns) as a tuple: one string is a list of one;
    anything but strings is a ValueError naming the option `what`."""
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"{what} must be a list of strings, got {value!r}") from None
    if not all(isinstance(v, str) for v in items):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")
    return items


def names_module(fragment: str, module_path: str) -> bool:
    """Hugging Face's keep-in-fp32 match: the fragment ("wo", "lm_head", "encoder.embed") is a run of whole
    dotted components of the module path ("decoder.block.0.layer.2.DenseReluDense.wo"), anywhere in it."""
    return re.search(rf"(^|\.){re.escape(fragment)}($|\.)", module_path) is not None


def pattern_matches(pattern: str, module_path: str, node_name: str) -> bool:
    """Whether a user's pattern (force_fp32, force_low, fp8_keep: a glob) names a node: its node name, or its
    module path or a module around it ("encoder.layers.*" covers every node inside each layer)."""
    if fnmatch.fnmatchcase(node_name, pattern):
        return True
    parts = module_path.split(".") if module_path else []
    # A module pattern covers everything inside that module.
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
