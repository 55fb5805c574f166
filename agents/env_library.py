"""The library: hand-written, verified environments shipped with trace-rl (sandbox/envs/), and the match of a
discovered capability to one of them, for when every builder round failed (`library_fallback`)."""
from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

from trace_rl.core.records import Capability


def library() -> dict[str, Path]:
    """Hand-written, verified environments shipped with trace-rl: {module name: path}.
    Named `<capability>_<target domain>.py`; a human (or an unattended run that allows it)
    can use one when the builder's attempts for that capability all fail."""
    root = resources.files("trace_rl.sandbox") / "envs"
    return {p.name[:-3]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".py")}


STOP_WORDS = frozenset("""a an and any are as at be before by can do does for from has have in into is it its
it's not of on or that the their them then this to use uses using when which with without agent agents user users
capability task tasks tool tools call calls calling environment reference right one two""".split())
LIBRARY_ALIASES: dict[str, str] = {  # discovered names that mean a library capability, by a person's reading
    "argument_precision": "tool_call_precision", "exact_tool_arguments": "tool_call_precision",
    "tool_argument_precision": "tool_call_precision", "schema_adherence": "tool_call_precision",
    "precondition_checking": "precondition_verification", "policy_precondition_checking": "precondition_verification",
    "eligibility_verification": "precondition_verification", "stateful_diagnosis": "mobile_data_troubleshooting",
    "diagnose_before_acting": "mobile_data_troubleshooting",
}


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower().replace("_", " ")) if len(w) > 2 and w not in STOP_WORDS}


def library_match(capability: Capability, target: str, min_shared: int = 4, min_share: float = 0.25) -> dict | None:
    """The library environment for `target` (e.g. tau2:telecom) that trains this capability, or None.

    A match is the library capability's own name, an alias of it (LIBRARY_ALIASES), or at least
    `min_shared` content words (no stop words), and `min_share` of the capability's, shared with
    its name and docstring. Returns {"path", "capability", "why"}; the adapter is then named
    and described after the library capability, not the discovered one."""
    domain = target.split(":")[-1].split("@")[0]  # tau2:airline@tau3 -> airline
    name = capability.name
    words = content_words(name + " " + capability.description)
    best = None
    for module, path in sorted(library().items()):
        if not module.endswith("_" + domain):
            continue
        lib_name = module[: -len(domain) - 1]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        entry = {"path": path,
                 "capability": Capability(name=lib_name, description=" ".join(doc.split("\n\n")[0].split()))}
        if name == lib_name or LIBRARY_ALIASES.get(name) == lib_name:
            return {**entry, "why": "same capability" if name == lib_name else f"alias of {lib_name}"}
        shared = words & content_words(lib_name + " " + doc)
        if len(shared) >= min_shared and len(shared) >= min_share * len(words) and \
                (best is None or len(shared) > len(best["shared"])):
            best = {**entry, "shared": shared}
    if best is None:
        return None
    shared = sorted(best.pop("shared"))
    return {**best, "why": f"shares {len(shared)} content words: {', '.join(shared)}"}
