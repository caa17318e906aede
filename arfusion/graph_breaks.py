"""Which graph break split an all-reduce from its norm, named from what Dynamo recorded.

An all-reduce whose value leaves its graph with no norm in it has its norm compiled in another
graph: Dynamo broke the model's code in between. Dynamo records every graph break it makes (its
message and the user stack: `torch._dynamo.utils.graph_break_reasons`). The break that split the
site is
- the one that ends the graph being compiled, where it ends at one;
- otherwise (the graph ends where its frame returns: Dynamo compiled that frame alone because a
  break inside the call split the frame that called it) the latest break recorded whose frame,
  the outermost of its user stack, is running now: the caller's, at its call into this frame.
Its function is the one `torch.compiler.disable` wraps, as the message names it, else the
innermost function of the user stack. Read only while the pass runs inside Dynamo's compile;
anywhere else (a graph compiled without Dynamo) nothing is named.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from torch._dynamo import utils as dynamo_utils
from torch._dynamo.symbolic_convert import InstructionTranslator

# What to do about breaks in code users do not own, by the function that breaks.
HINTS = {
    "PagedAttentionCache.update": "arfusion.hf.prepare_for_compile(model) keeps continuous batching's paged-cache "
                                  "update in the graph (transformers 5.19 to 5.24)",
    "ReplicatedWithGradAllReduce": "arfusion.hf.prepare_for_compile(model) drops these gradient-only hooks",
    "LongcatFlashExperts.forward": "arfusion.hf.prepare_for_compile(model) gives these experts a loop-free forward",
}
_DISABLED = re.compile(r"<function ([\w.<>]+) at 0x[0-9a-f]+>")


@dataclass(frozen=True)
class GraphBreak:
    """A graph break: the function that broke, where (file:line of the innermost user frame),
    and the first line of Dynamo's message."""

    function: str
    where: str
    message: str

    @property
    def hint(self) -> str:
        return next((h for name, h in HINTS.items() if name in self.function), "")

    @classmethod
    def of(cls, reason) -> "GraphBreak":
        frames = list(getattr(reason, "user_stack", None) or [])
        inner = frames[-1] if frames else None
        where = f"{Path(inner.filename).name}:{inner.lineno}" if inner is not None else "?"
        text = str(getattr(reason, "reason", ""))
        named = _DISABLED.search(text)
        function = named.group(1) if named else (inner.name if inner is not None else "?")
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return cls(function, where, first)


def _running() -> set[tuple[str, str]]:
    """(file, function) of every Python frame now on this thread's stack."""
    seen, frame = set(), sys._getframe(1)
    while frame is not None:
        seen.add((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return seen


def split_here() -> GraphBreak | None:
    """The graph break that separates the graph being compiled from the code after it, or None
    (no Dynamo compile under way, or no break recorded that explains it)."""
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no Dynamo translation on this thread
        return None
    reason = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        return GraphBreak.of(reason)
    running = _running()
    for recorded in reversed(dynamo_utils.graph_break_reasons):
        frames = recorded.user_stack or ()
        if frames and (frames[0].filename, frames[0].name) in running:
            return GraphBreak.of(recorded)
    return None
