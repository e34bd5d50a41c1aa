"""The paper-era benchmark's prompt building (z-lab/dflash at 98bde5f), transcribed as the oracle of the
``dflash-paper`` preset: ``model/utils.py::load_and_process_dataset`` (datasets' ``map`` over each set),
``benchmark.py``'s subsample (``shuffle(seed=0).select(range(n))`` only where a set is larger) and its prompt
encoding (``apply_chat_template(..., enable_thinking=False)``, then ``tokenizer.encode(text)`` with the
tokenizer's special tokens). Kept in the tests, apart from the package, so the preset is checked against the
authors' steps rather than against itself. The hub URLs stay as the authors wrote them: the tests point
``datasets.load_dataset`` at local copies.
"""

from __future__ import annotations

from typing import Any

_BOXED = "{%s}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
_LCB_FILES = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
_LCB_BASE = "https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/"


def _lcb(doc: dict[str, Any]) -> str:
    system = ("You are an expert Python programmer. You will be given a question (problem specification) "
              "and will generate a correct Python program that matches the specification and passes all tests. "
              "You will NOT return anything except for the program")
    if doc.get("starter_code"):
        fmt = "### Format: Use the following code structure:"
        code = f"```python\n{doc['starter_code']}\n```"
    else:
        fmt = "### Format: Write your code in the following format:"
        code = "```python\n# YOUR CODE HERE\n```"
    return (f"{system}\n\n### Question:\n{doc['question_content']}\n\n{fmt}\n{code}\n\n"
            "### Answer: (use the provided format with backticks)")


def load_and_process_dataset(name: str):
    """The set ``name`` with a ``turns`` column, as 98bde5f builds it."""
    from datasets import Features, Sequence, Value, load_dataset

    one = {  # name -> (load_dataset args, kwargs, format string over the row)
        "gsm8k": (("openai/gsm8k", "main"), {"split": "test"}, _BOXED % "question"),
        "math500": (("HuggingFaceH4/MATH-500",), {"split": "test"}, _BOXED % "problem"),
        "aime24": (("HuggingFaceH4/aime_2024",), {"split": "train"}, _BOXED % "problem"),
        "aime25": (("MathArena/aime_2025",), {"split": "train"}, _BOXED % "problem"),
        "humaneval": (("openai/openai_humaneval",), {"split": "test"},
                      "Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```"),
        "swe-bench": (("princeton-nlp/SWE-bench_Lite",), {"split": "test"},
                      "Problem Statement:\n{problem_statement}\nPlease fix the issue described above."),
    }
    if name in one:
        args, kwargs, fmt = one[name]
        return load_dataset(*args, **kwargs).map(lambda x: {"turns": [fmt.format(**x)]})
    if name == "alpaca":
        ds = load_dataset("tatsu-lab/alpaca", split="train")
        ds = ds.map(lambda x: {"formatted_input": (f"{x['instruction']}\n\nInput:\n{x['input']}"
                                                   if x["input"] else x["instruction"])})
        return ds.map(lambda x: {"turns": [x["formatted_input"]]})
    if name == "mt-bench":
        return load_dataset("HuggingFaceH4/mt_bench_prompts", split="train").map(lambda x: {"turns": x["prompt"]})
    if name == "mbpp":
        return load_dataset("google-research-datasets/mbpp", "sanitized", split="test").map(
            lambda x: {"turns": [x["prompt"]]})
    if name == "livecodebench":
        ds = load_dataset("json", data_files={"test": [_LCB_BASE + f for f in _LCB_FILES]})["test"]
        return ds.map(lambda x: {"turns": [_lcb(x)]}, remove_columns=ds.column_names,
                      features=Features({"turns": Sequence(Value("large_string"))}))
    raise ValueError(name)


def select(dataset, max_samples: int | None):
    """benchmark.py: a set larger than --max-samples is shuffled with seed 0 and cut."""
    if max_samples is not None and len(dataset) > max_samples:
        dataset = dataset.shuffle(seed=0).select(range(max_samples))
    return dataset


def encode_turn(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """benchmark.py: the chat template with thinking off, then the text encoded with special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return text, tokenizer.encode(text)


def prompts(name: str, max_samples: int | None, tokenizer) -> list[tuple[list[str], str, list[int]]]:
    """(turns, turn 1's text, turn 1's ids) of every selected row, in the benchmark's order."""
    out = []
    for instance in select(load_and_process_dataset(name), max_samples):
        text, ids = encode_turn(tokenizer, [{"role": "user", "content": instance["turns"][0]}])
        out.append((list(instance["turns"]), text, ids))
    return out
