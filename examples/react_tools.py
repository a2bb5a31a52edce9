"""A ReAct-style tool loop: the model thinks, picks a tool with ``select``, writes its input; the program runs the
tool and appends the observation, until the model picks ``finish``.

    python examples/react_tools.py
"""

from __future__ import annotations

import argparse
import ast
import operator

from radixserve.lang import Backend, RuntimeEndpoint, function, gen, select, system, user

FACTS = {
    "eiffel tower": "The Eiffel Tower is 330 metres tall.",
    "mount everest": "Mount Everest is 8,849 metres high.",
    "speed of sound": "Sound travels at about 343 metres per second in air.",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
INSTRUCTIONS = (
    "Answer the question with the tools. Tools: calculator (arithmetic such as 8849 - 330), lookup (facts about: "
    + ", ".join(FACTS)
    + "). Write one Thought, one Action (calculator, lookup or finish) and its Input per step; after finish, "
    "the Input is the final answer.\n\n"
    "Example:\nThought: I need the height of the tower.\nAction: lookup\nInput: eiffel tower\n"
    "Observation: The Eiffel Tower is 330 metres tall.\nThought: I know the answer.\nAction: finish\n"
    "Input: 330 metres"
)


def calculator(expression: str) -> str:
    """Arithmetic on numbers with + - * / and parentheses; anything else is refused (never ``eval``)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / are allowed")

    try:
        return f"{value(ast.parse(expression.strip().replace(',', ''), mode='eval').body):g}"
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def lookup(topic: str) -> str:
    key = next((k for k in FACTS if k in topic.lower()), None)
    return FACTS[key] if key else f"no fact about {topic.strip()!r}; known: {', '.join(FACTS)}"


TOOLS = {"calculator": calculator, "lookup": lookup}


@function
def react(s, question: str, max_steps: int = 4) -> str | None:
    s += system(INSTRUCTIONS)
    s += user(question)
    with s.assistant():
        for step in range(max_steps):
            s += "Thought:" + gen(f"thought_{step}", max_tokens=32, stop="\n") + "\n"
            s += "Action: " + select(f"action_{step}", ["calculator", "lookup", "finish"]) + "\n"
            s += "Input:" + gen(f"input_{step}", max_tokens=24, stop="\n") + "\n"
            action, tool_input = s[f"action_{step}"], s[f"input_{step}"]  # reading waits for the model
            if action == "finish":
                return tool_input.strip()
            s += f"Observation: {TOOLS[action](tool_input)}\n"
    return None


def main(backend: Backend, max_steps: int = 4) -> str | None:
    state = react.run(
        question="How much higher is Mount Everest than the Eiffel Tower?", max_steps=max_steps,
        backend=backend, temperature=0,
    )
    print(state.messages()[-1]["content"])
    print(f"final answer: {state.ret_value!r}")
    return state.ret_value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running radixserve server")
    main(RuntimeEndpoint(parser.parse_args().url))
