"""A multi-turn chat: system prompt, then user and assistant turns, rendered by the served model's chat template.

    python examples/multi_turn_chat.py
"""

from __future__ import annotations

import argparse

from radixserve.lang import Backend, RuntimeEndpoint, assistant, function, gen, system, user


@function
def multi_turn_chat(s, questions: list[str], max_tokens: int = 40) -> None:
    s += system("You are a friendly tour guide. Keep answers to one sentence.")
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer_{i}", max_tokens=max_tokens))


def main(backend: Backend, max_tokens: int = 40) -> list[dict[str, str]]:
    questions = ["I'm visiting Rome for one day. What should I see?", "And where should I eat lunch?"]
    state = multi_turn_chat.run(questions=questions, max_tokens=max_tokens, backend=backend, temperature=0)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    print(f"(cached prompt tokens of the second answer: {state.get_meta_info('answer_1')['cached_tokens']})")
    return state.messages()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
