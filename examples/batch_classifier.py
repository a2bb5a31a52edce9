"""A batch classifier: ``select`` over fixed labels, run over many inputs at once with ``run_batch``.

    python examples/batch_classifier.py
"""

from __future__ import annotations

import argparse

from radixserve.lang import Backend, RuntimeEndpoint, assistant, function, select, system, user

LABELS = ["sports", "politics", "technology", "food"]
DATA = [
    ("The striker scored twice in the second half to win the cup final.", "sports"),
    ("Parliament passed the budget after a long night of debate.", "politics"),
    ("The new phone has a faster chip and a brighter screen.", "technology"),
    ("Simmer the tomatoes with garlic and basil for twenty minutes.", "food"),
    ("The tennis champion retired after twenty years on tour.", "sports"),
    ("Voters head to the polls on Sunday to elect a new president.", "politics"),
    ("The software update fixes a bug that drained the battery.", "technology"),
    ("This bakery's sourdough has a crisp crust and a soft crumb.", "food"),
]


@function
def classify(s, text: str) -> None:
    s += system("Classify the topic of the text as one of: " + ", ".join(LABELS) + ".")
    s += user(text)
    s += assistant("Topic: " + select("topic", LABELS))


def main(backend: Backend) -> float:
    states = classify.run_batch([{"text": text} for text, _ in DATA], backend=backend)
    correct = 0
    for (text, label), state in zip(DATA, states):
        probs = state.get_meta_info("topic")["probs"]
        correct += state["topic"] == label
        print(f"{state['topic']:>10} (p={max(probs):.2f}, expected {label}): {text}")
    accuracy = correct / len(DATA)
    print(f"accuracy: {accuracy:.0%}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
