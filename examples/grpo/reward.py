"""The example run's reward: the fraction of response words equal to the target word.

A reward function takes the prompts (text, one per response: each prompt repeated once per
generation), the decoded responses and each prompt's metadata (the other fields of its JSONL
line), and returns one float per response.
"""


def target_word(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    rewards = []
    for response, meta in zip(responses, metadata, strict=True):
        words = response.split()
        target = meta.get("target", "t7")
        rewards.append(sum(w == target for w in words) / len(words) if words else 0.0)
    return rewards
