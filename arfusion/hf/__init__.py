"""Hugging Face helpers, for whatever transformers version is installed (decided by what it
offers, never by its version string).

    model = AutoModelForCausalLM.from_pretrained(path, **arfusion.hf.tp_kwargs("auto", config=path))
    arfusion.hf.prepare_for_compile(model)   # before torch.compile, generate(compile) or generate_batch

- `tp_kwargs`: the keywords that load a model tensor-parallel, with expert parallelism over the
  same ranks where the TP plan leaves a MoE model's experts whole (`loading`);
- `prepare_for_compile`: removes the graph breaks that transformers' own code puts between an
  all-reduce and its norm: gradient-only hooks and looped experts in model code (`model_code`),
  and the paged-cache update of continuous batching, with its decode fast path's Flash Attention
  call (`paged_cache`); and torch 2.15's recompile of every graph that continuous batching runs
  in another thread than the one that compiled it (`compile_setting`).

transformers is imported lazily, inside the functions: `import arfusion.hf` does not import it.
"""

from __future__ import annotations

from .compile_setting import same_compile_setting_in_every_thread
from .loading import experts_need_expert_parallel, say_if_experts_are_whole, tp_kwargs
from .model_code import drop_grad_allreduce_hooks, loop_free_experts
from .paged_cache import keep_paged_cache_in_graph, release_paged_cache

__all__ = ["tp_kwargs", "experts_need_expert_parallel", "say_if_experts_are_whole", "prepare_for_compile",
           "drop_grad_allreduce_hooks", "loop_free_experts", "keep_paged_cache_in_graph", "release_paged_cache",
           "same_compile_setting_in_every_thread"]


def prepare_for_compile(model) -> dict[str, int]:
    """Removes the graph breaks that transformers' own code puts in an inference model, so that
    every all-reduce meets its norm in one graph; returns what each step changed:
    `grad_allreduce_hooks_dropped` and `experts_made_loop_free` (this model's modules), and
    `paged_cache_in_graph` (1 where continuous batching's caches now keep their update in the
    graph, for every model of the process: `keep_paged_cache_in_graph`) and `setting_alike_in_threads`
    (1 where a graph compiled in one thread no longer recompiles in another, for the process:
    `same_compile_setting_in_every_thread`, torch 2.15). Inference only. Says at
    INFO where a MoE model's experts were loaded whole on every rank (`say_if_experts_are_whole`)."""
    in_graph, _ = keep_paged_cache_in_graph()
    alike, _ = same_compile_setting_in_every_thread()
    say_if_experts_are_whole(model)
    return {"grad_allreduce_hooks_dropped": drop_grad_allreduce_hooks(model),
            "experts_made_loop_free": loop_free_experts(model),
            "paged_cache_in_graph": int(in_graph), "setting_alike_in_threads": int(alike)}
