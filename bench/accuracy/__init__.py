"""End-to-end accuracy harness: RULER-style synthetic long-context tasks served through vLLM.

Modules, one concept each:

* :mod:`bench.accuracy.prose` -- the haystack (real prose) and prompt sizing;
* :mod:`bench.accuracy.tasks` -- the task generators (needles, variable tracking, common words,
  question over a passage);
* :mod:`bench.accuracy.scoring` -- containment scorers;
* :mod:`bench.accuracy.runner` -- configurations and the vLLM offline engine loop;
* :mod:`bench.accuracy.report` -- tables, JSON and the bar plot;
* :mod:`bench.accuracy.__main__` -- the command line (``python -m bench.accuracy``).
"""
