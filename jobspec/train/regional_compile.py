"""`model.compile` on the ranks: regional compilation, and the time it takes.

torch.compile goes on each layer of the model's layer stack (model/structure.find_layer_stack: the
decoder or encoder layers, inside a PEFT model too), not on the whole model: the layers are
instances of one class, and dynamo passes their parameters as inputs (`inline_inbuilt_nn_modules`),
so one compiled graph serves every layer and the compile time is one layer's whatever the depth
(torch's "regional compilation" recipe; torchtitan and accelerate compile the repeated block the
same way). The patch is the last one: the layers it compiles carry the checkpointing wrappers and
the LoRA adapters already, and DeepSpeed (ZeRO 0-2) wraps the model after it; its gradient hooks sit
on the parameters, outside the compiled graphs. The KV cache is turned off for training
(`use_cache`): its per-layer state would be a guard of every layer and recompile each one.
Generation (train/generation) runs eager.

torch compiles lazily: the forward graph at the first forward, the backward graph at the first
backward, both inside the launch's first optimizer step. `CompileClock` times them from dynamo's
compile callbacks and, once the first optimizer step has run, writes the `compiled` start-up phase
(at the end of the last compilation) and a note with the seconds to launcher.log (`jobspec-log:
torch.compile: ...`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from jobspec import launcher_log
from jobspec.model.structure import find_layer_stack


def regional_compile(model, **compile_kwargs):
    """torch.compile on each layer of the layer stack, in place (`nn.Module.compile`); without a
    layer stack the whole model is compiled. Returns (model, note); `compile_kwargs` go to
    torch.compile."""
    import torch

    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    layers = find_layer_stack(model)
    CompileClock.started().watch()
    if layers is None:
        compiled = torch.compile(model, **compile_kwargs)
        whole = type(model).__name__
        return compiled, (f"torch.compile: the whole {whole} (no layer stack found), compiled in "
                          "the first step")
    for layer in layers:
        layer.compile(**compile_kwargs)
    kinds = sorted({type(layer).__name__ for layer in layers})
    return model, (f"torch.compile: regional, on each of the {len(layers)} layers "
                   f"({', '.join(kinds)}), which share their compiled graphs; compiled in the "
                   "first step")


@dataclass
class CompileClock:
    """Wall-clock seconds of dynamo's compilations in this process (the graphs dynamo traces, with
    their backward when torch compiles it ahead or loads it from its cache, and the backward graphs
    compiled lazily at their first backward), reported once after the first optimizer step."""

    seconds: float = 0.0
    compilations: int = 0
    lazy_backward: int = 0    # of them: a backward graph compiled at its first backward
    last_end: float | None = None   # time.time() at the end of the latest compilation
    reported: bool = False
    _began: float | None = None
    _hooks: list = field(default_factory=list)

    _instance = None

    @classmethod
    def started(cls) -> CompileClock:
        """The process's one clock (a rebuilt engine compiles again into the same clock)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def watch(self) -> None:
        """Register dynamo's compile callbacks and the first-optimizer-step report (once per
        process)."""
        if self._hooks:
            return
        from torch._dynamo.callback import callback_handler
        from torch.optim.optimizer import register_optimizer_step_post_hook

        callback_handler.register_start_callback(self.begin)
        callback_handler.register_end_callback(self.end)
        self._hooks = [register_optimizer_step_post_hook(self.after_step)]

    def stop(self) -> None:
        """No more callbacks or hooks from this clock."""
        from torch._dynamo.callback import callback_handler

        for callbacks, own in ((callback_handler.start_callbacks, self.begin),
                               (callback_handler.end_callbacks, self.end)):
            if own in callbacks:
                callbacks.remove(own)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def begin(self, args) -> None:
        self._began = time.perf_counter()
        self.compilations += 1
        if args.callback_trigger.name == "LAZY_BACKWARD":
            self.lazy_backward += 1

    def end(self, args) -> None:
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None
        self.last_end = time.time()

    def after_step(self, optimizer, args, kwargs) -> None:
        """After an optimizer step (torch's global hook, any optimizer): the first one with a
        compilation behind it writes the phase and the note."""
        if self.reported or self.last_end is None:
            return
        self.reported = True
        for hook in self._hooks:
            hook.remove()
        rank = f"rank{os.environ.get('RANK', '0')}"
        launcher_log.phase(rank, "compiled", at=self.last_end)
        launcher_log.note(self.note())

    def note(self) -> str:
        lazy = (f" ({self.lazy_backward} of them backward graphs compiled at their first backward)"
                if self.lazy_backward else "")
        plural = "s" if self.compilations != 1 else ""
        return (f"torch.compile: {self.seconds:.1f} s for {self.compilations} "
                f"compilation{plural}{lazy}, inside the first step (torch compiles lazily: that "
                "step's time includes it)")
