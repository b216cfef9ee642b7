"""A step graph against the same step run eagerly: their logits compared, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.model_runner import ModelRunner


@dataclass
class GraphVsEager:
    """While installed (``with``), each step of ``runner`` that replays one of ``graphs`` (the
    runner's attribute ``attr``) runs eagerly too, and the eager logits go on; records the
    largest logit difference (finite entries: both are -inf past the vocabulary) and the rows
    whose argmax agrees."""

    runner: ModelRunner
    attr: str
    diffs: list[float] = field(default_factory=list)
    rows: int = 0
    agree: int = 0

    def __enter__(self) -> GraphVsEager:
        runner, graphs = self.runner, getattr(self.runner, self.attr)
        run_step = runner.run_step

        def both(*args):
            chosen = runner._step_graphs(args[0])
            if chosen is None or chosen[0] is not graphs:
                return run_step(*args)
            graph = run_step(*args).float()
            setattr(runner, self.attr, None)
            eager = run_step(*args)
            setattr(runner, self.attr, graphs)
            diff = (graph - eager.float()).abs()
            self.diffs.append(float(diff[diff.isfinite()].max()))
            self.rows += eager.shape[0]
            self.agree += int((graph.argmax(-1) == eager.argmax(-1)).sum())
            return eager

        runner.run_step = both
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.run_step  # the class's method again

    def summary(self, name: str) -> str:
        return (f"{name} graph vs eager: {len(self.diffs)} steps, max |logit difference| "
                f"{max(self.diffs, default=0.0):.4f}, argmax equal in {self.agree}/{self.rows} "
                "rows")

