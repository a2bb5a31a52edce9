"""Tree of thought with nested forks: several approaches, several answers per approach, then the model itself
picks the best answer with ``select``. Every branch shares the question's prefix in the server's cache.

    python examples/tree_of_thought.py
"""

from __future__ import annotations

import argparse
from typing import Any

from radixserve.lang import Backend, RuntimeEndpoint, function, gen, select, system, user


@function
def tree_of_thought(s, question: str, breadth: int = 2, max_tokens: int = 32) -> dict[str, Any]:
    s += system("You solve problems by trying different approaches.")
    s += user(question)
    with s.assistant():
        s += "Approach:"
        plans = s.fork(breadth)  # level 1: one branch per approach
        for i, plan in enumerate(plans):
            plan += gen("plan", max_tokens=max_tokens, stop="\n", temperature=0.8, seed=i)
            plan += "\nAnswer:"
        leaves = []
        for i, plan in enumerate(plans):
            answers = plan.fork(breadth)  # level 2: answers under each approach
            for j, answer in enumerate(answers):
                answer += gen("answer", max_tokens=max_tokens, stop="\n", temperature=0.8, seed=10 * i + j)
            leaves.extend(answers)
        candidates = list(dict.fromkeys(leaf["answer"].strip() for leaf in leaves if leaf["answer"].strip()))
        if candidates:
            s += "I considered: " + "; ".join(candidates) + "\nThe best answer is: " + select("best", candidates)
    return {
        "plans": [plan["plan"].strip() for plan in plans],
        "candidates": candidates,
        "best": s["best"] if candidates else None,
    }


def main(backend: Backend, breadth: int = 2, max_tokens: int = 32) -> dict[str, Any]:
    question = "A farmer has 17 sheep and all but 9 run away. How many sheep are left?"
    state = tree_of_thought.run(question=question, breadth=breadth, max_tokens=max_tokens, backend=backend)
    result = state.ret_value
    for i, plan in enumerate(result["plans"]):
        print(f"approach {i}: {plan}")
    print("candidates:", result["candidates"])
    print("best:", result["best"])
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
