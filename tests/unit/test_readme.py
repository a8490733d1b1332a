from pathlib import Path

from cotrain import flagtable

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_flag_table_matches_the_code():
    assert flagtable.current(README.read_text()) == flagtable.render(), (
        "README's flag table is stale: run `python -m cotrain.flagtable README.md`"
    )


def test_every_original_flag_in_the_table_parses():
    from cotrain import cli

    for seed, flag, roles, _ in flagtable.rows():
        role = roles.split(", ")[0]
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[role]
        assert seed in sub._option_string_actions, (seed, role)
        assert flag in sub._option_string_actions, (flag, role)


def test_readme_holds_the_two_commands():
    text = README.read_text()
    assert "pip install torch==2.13.0" in text and "cotrain demo" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in text and ci.strip().endswith("python -m pytest")


def test_readme_shows_both_strategies_and_links_the_diloco_guide():
    text = README.read_text()
    assert "cotrain demo --strategy diloco" in text and '"strategy": "diloco"' in text
    assert "[docs/diloco.md](docs/diloco.md)" in text
    for flag in ("--strategy", "--local-steps", "--outer-lr", "--outer-momentum", "--outer-overlap"):
        assert flag in text, flag


def test_the_readme_shows_the_demo_summary_with_every_field_the_demo_prints():
    import re

    from cotrain.demo import summarize

    line = next(x for x in README.read_text().splitlines() if '{"event": "demo_summary"' in x)
    shown = re.findall(r'"(\w+)":', line)
    printed = summarize([{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}], peers=2, seconds=1.0)
    assert shown == list(printed), (shown, list(printed))
