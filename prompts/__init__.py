"""Markdown prompts, shipped as package data. `load("name")` reads `name.md`."""
from importlib import resources


def load(name: str, **fields: str) -> str:
    """The prompt `name`.md with `{field}` placeholders filled (unknown braces kept)."""
    text = (resources.files(__name__) / f"{name}.md").read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def names() -> list[str]:
    return sorted(p.name[:-3] for p in resources.files(__name__).iterdir() if p.name.endswith(".md"))
