"""Few-shot question answering: plain text (no chat roles), answers cut at the end of the line.

    radixserve serve &        # then
    python examples/few_shot_qa.py
"""

from __future__ import annotations

import argparse

from radixserve.lang import Backend, RuntimeEndpoint, function, gen

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "Eight"),
    ("What colour is the sky on a clear day?", "Blue"),
]


@function
def few_shot_qa(s, question: str) -> None:
    s += "Answer each question with a word or two.\n\n"
    for q, a in EXAMPLES:  # the same few-shot block for every question: served from the prefix cache
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + gen("answer", max_tokens=8, stop="\n")


def main(backend: Backend) -> list[str]:
    questions = ["What is the capital of Italy?", "How many days are in a week?", "What do bees make?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)
    for q, state in zip(questions, states):
        print(f"{q} -> {state['answer'].strip()!r}")
    return [state["answer"] for state in states]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
