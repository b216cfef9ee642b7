"""Quality at the serving defaults: 30 everyday questions with checkable answers (facts,
arithmetic, translations, short code tasks), answered through the chat template by each CPU
weight quantization and, as the reference, by llama.cpp on the same GGUF.

Every configuration answers every question greedily (temperature 0) and sampled at the
gateway's defaults for SmolLM2 (temperature 0.2, top_p 0.9) with each of ``--seeds``, all at
one ``--max-tokens`` so that a loop shows as one. Per configuration:

- **correct**: the answer matches one of the question's accepted patterns (regular
  expressions, case-insensitive, anywhere in the answer);
- **loops**: the answer's last :data:`LOOP_WINDOW` tokens (the SmolLM2 tokenizer's tokens of
  the answer text, for every configuration alike) repeat one n-gram of at most
  :data:`LOOP_MAX_PERIOD` tokens, i.e. ``t[i] == t[i - p]`` throughout that tail for some
  ``p <= LOOP_MAX_PERIOD``: at least three copies of it fill the tail;
- **cut**: the answer stopped at ``--max-tokens`` (finish reason ``length``);
- mean answer length in tokens, and decode speed: one stream (one greedy request,
  ``ignore_eos``, ``--speed-tokens`` tokens) and offline (every answer of the configuration
  generated at once — for llama.cpp ``--llama-parallel`` requests in flight — output tokens
  over the wall time).

    python benchmarks/everyday_questions.py --llama-server-bin /path/to/llama-server
    python benchmarks/everyday_questions.py --quick   # smoke test: 2 questions, a few tokens

Progress goes to stderr; the tables to stdout and ``everyday_questions.txt``, every answer
(text cut to :data:`KEPT_CHARS` characters) to ``everyday_questions.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import Run, add_out_argument, mean  # noqa: E402

LOOP_WINDOW = 96
LOOP_MAX_PERIOD = 32
KEPT_CHARS = 120
QUICK_QUESTIONS = 2


@dataclass(frozen=True)
class Question:
    kind: str
    prompt: str
    accept: tuple[str, ...]  # regular expressions; any match, case-insensitive, is correct

    def is_correct(self, answer: str) -> bool:
        return any(re.search(p, answer, re.IGNORECASE | re.DOTALL) for p in self.accept)


QUESTIONS = [
    Question("fact", "What is the capital of France?", ("paris",)),
    Question("fact", "What is the capital of Japan?", ("tokyo",)),
    Question("fact", "What is the capital of Italy?", (r"\brome\b", r"\broma\b")),
    Question("fact", "What is the largest planet in our solar system?", ("jupiter",)),
    Question("fact", "Which planet is known as the Red Planet?", (r"\bmars\b",)),
    Question("fact", "Who wrote the play Romeo and Juliet?", ("shakespeare",)),
    Question("fact", "What is the chemical formula of water?", (r"h2o", "h₂o")),
    Question("fact", "What color do you get when you mix blue and yellow?", ("green",)),
    Question("fact", "How many continents are there on Earth?", (r"\b7\b", r"\bseven\b")),
    Question("fact", "How many legs does a spider have?", (r"\b8\b", r"\beight\b")),
    Question("fact", "At what temperature in degrees Celsius does water boil at sea level?",
             (r"\b100\b",)),
    Question("fact", "What is the tallest mountain in the world?", ("everest",)),
    Question("fact", "On which continent is Egypt?", ("africa",)),
    Question("fact", "What gas do plants take in from the air for photosynthesis?",
             ("carbon dioxide", r"\bco2\b", "co₂")),
    Question("fact", "How many days are there in a week?", (r"\b7\b", r"\bseven\b")),
    Question("fact", "How many minutes are there in an hour?", (r"\b60\b", r"\bsixty\b")),
    Question("arithmetic", "What is 2 + 2?", (r"\b4\b", r"\bfour\b")),
    Question("arithmetic", "What is 7 times 8?", (r"\b56\b",)),
    Question("arithmetic", "What is 100 minus 37?", (r"\b63\b",)),
    Question("arithmetic", "What is 15 + 27?", (r"\b42\b",)),
    Question("arithmetic", "What is 12 divided by 4?", (r"\b3\b", r"\bthree\b")),
    Question("arithmetic", "What is half of 50?", (r"\b25\b",)),
    Question("arithmetic", "What is 9 squared?", (r"\b81\b",)),
    Question("translation", "Translate 'thank you' into French.", ("merci",)),
    Question("translation", "Translate 'hello' into Spanish.", ("hola",)),
    Question("translation", "Translate 'good morning' into German.", ("guten morgen",)),
    Question("translation", "What is the French word for 'cat'?", (r"\bchat\b",)),
    Question("code", "Write a Python function that returns the sum of two numbers.",
             (r"def \w+\(\s*\w+\s*,\s*\w+\s*\)\s*:.*return\s+\w+\s*\+\s*\w+",)),
    Question("code", "In Python, how do you reverse a string s?",
             (r"s\[\s*::\s*-1\s*\]", r"reversed\(\s*s\s*\)")),
    Question("code", "In Python, how do you get the number of items in a list called items?",
             (r"len\(\s*items\s*\)",)),
]


@dataclass
class Answer:
    question: int
    run: str  # "greedy" or "seed N"
    text: str
    tokens: int
    finish: str | None
    correct: bool = False
    loop: bool = False


@dataclass
class Measured:
    answers: list[Answer]
    offline_tok_s: float
    one_stream_tok_s: float


def progress(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def loop_period(ids: list[int], window: int = LOOP_WINDOW,
                max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The shortest ``p <= max_period`` with the last ``window`` tokens of ``ids`` repeating
    with period ``p``, or None: no repeated n-gram fills the tail (or it is shorter)."""
    if len(ids) < window:
        return None
    tail = ids[-window:]
    for p in range(1, max_period + 1):
        if all(tail[i] == tail[i - p] for i in range(p, window)):
            return p
    return None


def run_label(seed: int | None) -> str:
    return "greedy" if seed is None else f"seed {seed}"


def conversation(question: Question) -> list[dict[str, str]]:
    return [{"role": "user", "content": question.prompt}]


# -- chatgate's engine --------------------------------------------------------------------------

def engine_params(seed: int | None, max_tokens: int):  # noqa: ANN201 - SamplingParams
    """Greedy for ``seed`` None, else the serving defaults for SmolLM2 with ``seed``."""
    from engine import SamplingParams
    from engine.loader.gguf import SMOLLM2_GENERATION_DEFAULTS

    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(**SMOLLM2_GENERATION_DEFAULTS.values(), seed=seed,
                          max_tokens=max_tokens)


def engine_one_stream(llm, tokens: int) -> float:  # noqa: ANN001 - engine.LLM
    """Output tokens/s of one greedy request of ``tokens`` tokens (``ignore_eos``)."""
    from engine import SamplingParams

    chat = conversation(QUESTIONS[0])
    llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    out = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)


def measure_engine(args: argparse.Namespace, quantization: str,
                   questions: list[Question]) -> Measured:
    """Every answer of ``quantization`` in one offline batch, then the one-stream speed."""
    from engine import LLM

    llm = LLM(args.model, device="cpu", quantization=quantization, max_model_len=1024)
    jobs = [(i, seed) for seed in args.seeds for i in range(len(questions))]
    start = time.perf_counter()
    outs = llm.chat([conversation(questions[i]) for i, _ in jobs],
                    [engine_params(seed, args.max_tokens) for _, seed in jobs])
    wall = time.perf_counter() - start
    answers = [Answer(i, run_label(seed), o.outputs[0].text, len(o.outputs[0].token_ids),
                      o.outputs[0].finish_reason) for (i, seed), o in zip(jobs, outs, strict=True)]
    offline = sum(a.tokens for a in answers) / wall
    return Measured(answers, offline, engine_one_stream(llm, args.speed_tokens))


# -- llama.cpp ----------------------------------------------------------------------------------

def llama_body(prompt: list[dict[str, str]], seed: int | None, max_tokens: int) -> dict:
    """A /v1/chat/completions body with the engine's sampling: llama.cpp's own extra samplers
    (top_k 40, min_p 0.05 by default) switched off."""
    from engine.loader.gguf import SMOLLM2_GENERATION_DEFAULTS

    sampling = ({"temperature": 0.0, "seed": 0} if seed is None else
                {**SMOLLM2_GENERATION_DEFAULTS.values(), "seed": seed})
    return {"model": "smollm2", "messages": prompt, "max_tokens": max_tokens, "top_k": 0,
            "min_p": 0.0, "repeat_penalty": 1.0, **sampling}


def llama_chat(url: str, body: dict) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish reason) of one request."""
    import httpx

    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return choice["message"]["content"], data["usage"]["completion_tokens"], choice[
        "finish_reason"]


def llama_one_stream(url: str, tokens: int) -> float:
    chat = conversation(QUESTIONS[0])
    llama_chat(url, llama_body(chat, None, 2))  # warm-up
    start = time.perf_counter()
    _, n, _ = llama_chat(url, {**llama_body(chat, None, tokens), "ignore_eos": True})
    return n / (time.perf_counter() - start)


def llama_answers(url: str, args: argparse.Namespace, questions: list[Question]) -> Measured:
    jobs = [(i, seed) for seed in args.seeds for i in range(len(questions))]

    def answer(job: tuple[int, int | None]) -> Answer:
        i, seed = job
        text, n, finish = llama_chat(url, llama_body(conversation(questions[i]), seed,
                                                     args.max_tokens))
        return Answer(i, run_label(seed), text, n, finish)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.llama_parallel) as pool:
        answers = list(pool.map(answer, jobs))
    offline = sum(a.tokens for a in answers) / (time.perf_counter() - start)
    return Measured(answers, offline, llama_one_stream(url, args.speed_tokens))


def measure_llama(args: argparse.Namespace, questions: list[Question]) -> Measured:
    """The same questions through ``llama-server`` on the packaged GGUF (its chat template
    through ``--jinja``, as the engine renders it)."""
    import subprocess
    import tempfile

    from benchmarks._common import free_port
    from benchmarks.serving import Server, gguf_path, wait_ready

    port, slots = free_port(), args.llama_parallel
    cmd = [str(args.llama_server_bin), "-m", gguf_path(), "--host", "127.0.0.1", "--port",
           str(port), "--parallel", str(slots), "-c", str(1024 * slots), "-t", "2", "-tb", "2",
           "--cont-batching", "--no-webui", "--jinja"]
    log_path = Path(tempfile.gettempdir()) / "bench_everyday_llamacpp_server.log"
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    server = Server("llama.cpp", f"http://127.0.0.1:{port}", proc, "llama-server", log_path)
    try:
        wait_ready(server, timeout=120)
        return llama_answers(server.url, args, questions)
    finally:
        server.stop()


# -- scoring and the report ---------------------------------------------------------------------

def score(answers: list[Answer], questions: list[Question], tokenizer) -> None:  # noqa: ANN001
    for a in answers:
        a.correct = questions[a.question].is_correct(a.text)
        ids = tokenizer.encode(a.text, add_special_tokens=False)
        a.loop = loop_period(ids) is not None


def summary(m: Measured, n_questions: int, seeds: list[int | None]) -> dict:
    greedy = [a for a in m.answers if a.run == "greedy"]
    sampled = [a for a in m.answers if a.run != "greedy"]
    n_sampled_runs = sum(s is not None for s in seeds)
    return {
        "questions": n_questions,
        "greedy_correct": sum(a.correct for a in greedy),
        "sampled_correct_mean": (sum(a.correct for a in sampled) / n_sampled_runs
                                 if n_sampled_runs else float("nan")),
        "greedy_loops": sum(a.loop for a in greedy),
        "sampled_loops": sum(a.loop for a in sampled),
        "cut": sum(a.finish == "length" for a in m.answers),
        "answers": len(m.answers),
        "mean_tokens": mean(a.tokens for a in m.answers),
        "one_stream_tok_s": m.one_stream_tok_s,
        "offline_tok_s": m.offline_tok_s,
    }


def summary_rows(summaries: dict[str, dict]) -> list[list[object]]:
    return [[name, f"{s['greedy_correct']}/{s['questions']}",
             f"{s['sampled_correct_mean']:.1f}/{s['questions']}", s["greedy_loops"],
             s["sampled_loops"], f"{s['cut']}/{s['answers']}", s["mean_tokens"],
             s["one_stream_tok_s"], s["offline_tok_s"]] for name, s in summaries.items()]


SUMMARY_HEADER = ("config", "greedy correct", "sampled correct (mean)", "greedy loops",
                  "sampled loops", "cut", "mean tokens", "tok/s 1 stream", "tok/s offline")


def cell(answers: list[Answer]) -> str:
    """One question's result in one configuration: greedy (ok / wrong / loop), then how many
    sampled answers were correct."""
    greedy = next(a for a in answers if a.run == "greedy")
    mark = "loop" if greedy.loop else "ok" if greedy.correct else "wrong"
    sampled = [a for a in answers if a.run != "greedy"]
    if not sampled:
        return mark
    return f"{mark} {sum(a.correct for a in sampled)}/{len(sampled)}"


def question_rows(results: dict[str, Measured], questions: list[Question]) -> list[list[str]]:
    rows = []
    for i, q in enumerate(questions):
        rows.append([q.prompt[:48]] + [cell([a for a in m.answers if a.question == i])
                                        for m in results.values()])
    return rows


def plot(run: Run, summaries: dict[str, dict]) -> None:
    def draw(ax) -> None:  # noqa: ANN001 - matplotlib axes
        for name, s in summaries.items():
            ax.scatter(s["offline_tok_s"], s["greedy_correct"], marker="o", color="C0")
            ax.scatter(s["offline_tok_s"], s["sampled_correct_mean"], marker="x", color="C1")
            ax.annotate(name, (s["offline_tok_s"], s["greedy_correct"]),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.scatter([], [], marker="o", color="C0", label="greedy")
        ax.scatter([], [], marker="x", color="C1", label="sampled (mean of seeds)")
        ax.set_xlabel("offline decode, output tokens/s")
        ax.set_ylabel(f"correct answers (of {next(iter(summaries.values()))['questions']})")
        ax.set_title("everyday questions: correct vs speed")

    run.plot(f"{run.stem}.png", draw)


def parse_seeds(text: str) -> list[int | None]:
    """``greedy,0,1,2`` → [None, 0, 1, 2]."""
    return [None if s == "greedy" else int(s) for s in text.split(",") if s]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantizations", default="none,int8,int4",
                    help="comma-separated --quantization values to compare")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("greedy,0,1,2"),
                    help="runs: 'greedy' and sampling seeds, comma-separated")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS),
                    help="the first N questions")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--speed-tokens", type=int, default=128,
                    help="tokens of the one-stream speed request")
    ap.add_argument("--llama-server-bin", type=Path, default=None,
                    help="llama.cpp's llama-server; without it the llama.cpp column is skipped")
    ap.add_argument("--llama-parallel", type=int, default=8,
                    help="llama-server slots and requests in flight offline")
    ap.add_argument("--quick", action="store_true",
                    help=f"a tiny run (smoke test): {QUICK_QUESTIONS} questions, a few tokens")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    args.quantizations = args.quantizations.split(",")
    if args.quick:
        args.questions, args.max_tokens, args.speed_tokens = QUICK_QUESTIONS, 8, 4
    return args


def measure_all(args: argparse.Namespace, questions: list[Question]) -> dict[str, Measured]:
    results: dict[str, Measured] = {}
    for quantization in args.quantizations:
        progress(f"== quantization {quantization}: {len(questions) * len(args.seeds)} answers")
        results[quantization] = measure_engine(args, quantization, questions)
    if args.llama_server_bin is None:
        progress("no --llama-server-bin: the llama.cpp column is skipped")
    else:
        progress(f"== llama.cpp ({args.llama_server_bin})")
        results["llama.cpp"] = measure_llama(args, questions)
    return results


def main(argv: list[str] | None = None) -> int:
    from engine.loader import load_tokenizer

    args = parse_args(argv)
    questions = QUESTIONS[:args.questions]
    run = Run(args.out, "everyday_questions", quick=args.quick, argv=argv)
    results = measure_all(args, questions)
    tokenizer = load_tokenizer(args.model)
    for m in results.values():
        score(m.answers, questions, tokenizer)
    summaries = {name: summary(m, len(questions), args.seeds) for name, m in results.items()}
    run(f"max_tokens {args.max_tokens}; runs: "
        f"{', '.join(run_label(s) for s in args.seeds)}; sampled at the serving defaults "
        f"(temperature 0.2, top_p 0.9); loop = last {LOOP_WINDOW} tokens repeat an n-gram of "
        f"at most {LOOP_MAX_PERIOD} tokens")
    run.section("per question (greedy: ok / wrong / loop; then sampled answers correct)",
                question_rows(results, questions), ["question", *results])
    run.section("summary", summary_rows(summaries), SUMMARY_HEADER)
    run.write_json({"args": {k: str(v) for k, v in vars(args).items()},
                    "loop_window": LOOP_WINDOW, "loop_max_period": LOOP_MAX_PERIOD,
                    "summaries": summaries,
                    "answers": {name: [{**asdict(a), "text": a.text[:KEPT_CHARS]}
                                       for a in m.answers] for name, m in results.items()}})
    plot(run, summaries)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
