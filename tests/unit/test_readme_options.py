"""The options table is the one hvdtrain.options makes from config.py's fields, in the doc beside
config.py that README.md links (single process, no TensorFlow)."""

from conftest import REPO

from hvdtrain.options import (OPTIONS_BEGIN, OPTIONS_DOC, OPTIONS_END, options_markdown,
                              with_options_table)


def test_options_table_is_generated_from_config():
    doc = (REPO / OPTIONS_DOC).read_text()
    assert OPTIONS_BEGIN in doc and OPTIONS_END in doc, f"{OPTIONS_DOC} lost its option markers"
    shown = doc.split(OPTIONS_BEGIN, 1)[1].split(OPTIONS_END, 1)[0]
    assert shown.strip() == options_markdown().strip(), (
        f"{OPTIONS_DOC}'s options table differs from hvdtrain/config.py's fields; regenerate it "
        f"with 'python -m hvdtrain.options --write {OPTIONS_DOC}'")
    assert with_options_table(doc) == doc


def test_readme_links_the_options_table_and_holds_no_stale_copy():
    readme = (REPO / "README.md").read_text()
    assert f"]({OPTIONS_DOC}#options)" in readme
    assert OPTIONS_END not in readme
