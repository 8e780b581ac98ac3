"""Default system prompts of the built-in reward types (used when ``-s/--system-prompt`` is not given).

The embedded tiny model was pre-trained with exactly these prompts, so changing one
changes what the default run sees: rebuild the model with ``scripts/build_tiny_model.py``.
"""

DEFAULT_SYSTEM_PROMPTS: dict[str, str] = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "think_answer_tags": (
        "You are a helpful assistant. A conversation between User and Assistant. The user asks a question, "
        "and the Assistant solves it. The assistant first thinks about the reasoning process in the mind and "
        "then provides the user with the answer. The reasoning process and answer are enclosed within "
        "<think> </think> and <answer> </answer> tags, respectively, i.e., "
        "<think> reasoning process here </think><answer> answer here </answer>."
    ),
    "code": (
        "You are a helpful programming assistant. Solve the problem in Python 3. The program reads from "
        "standard input and writes to standard output. Put the complete program in one ```python code block."
    ),
    "model": "You are a helpful assistant.",  # a reward model (or a judge) asks for no answer format
    "judge": "You are a helpful assistant.",
}


def system_prompt_for(reward_type: str, override: str | None) -> str:
    """The system prompt a run uses: the user's ``-s`` if given, else the reward type's default."""
    if override is not None:
        return override
    return DEFAULT_SYSTEM_PROMPTS[reward_type]
