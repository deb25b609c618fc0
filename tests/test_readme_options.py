"""README.md's options table is the one config.py generates (single process, no TensorFlow)."""

from conftest import REPO

from hvdtrain.config import OPTIONS_BEGIN, OPTIONS_END, options_markdown, with_options_table


def test_readme_options_table_is_generated_from_config():
    readme = (REPO / "README.md").read_text()
    assert OPTIONS_BEGIN in readme and OPTIONS_END in readme, "README lost its option markers"
    shown = readme.split(OPTIONS_BEGIN, 1)[1].split(OPTIONS_END, 1)[0]
    assert shown.strip() == options_markdown().strip(), (
        "README.md's options table differs from hvdtrain/config.py's fields; regenerate it with "
        "'python -m hvdtrain.config --write README.md'")
    assert with_options_table(readme) == readme
