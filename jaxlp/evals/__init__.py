"""Evaluations and analyses of jaxlp models, importable (the scripts in scripts/ wrap them).

- :mod:`~jaxlp.evals.reasoner`: accuracy of the testbed reasoner across weight formats x
  samplers x KV caches (ReSET Tables 1, 2, 5); planning in :mod:`~jaxlp.evals.reasoner_plan`,
  tables and plot in :mod:`~jaxlp.evals.reasoner_report`, intervals in :mod:`~jaxlp.evals.stats`,
  several samplers / caches in one program in :mod:`~jaxlp.evals.rowgroups`.
- :mod:`~jaxlp.evals.entropy`: token and step entropies under NVFP4 (Figures 2, 3, 8).
- :mod:`~jaxlp.evals.kvcache`: perplexity, KL and size of KV caches by teacher-forced decoding.
- :mod:`~jaxlp.evals.quality`: perplexity, KL and weight error of quantization recipes.
- :mod:`~jaxlp.evals.traces`: a ReSET generation replayed and plotted.
- :mod:`~jaxlp.evals.harness`: timing, run metadata and JSON for the benchmark scripts.

This is the top layer: it imports the rest of jaxlp; nothing in jaxlp imports it.
"""

from jaxlp.evals.entropy import analyse, distribution, run_entropy_analysis
from jaxlp.evals.harness import Timing, plot_lines, run_metadata, time_call, write_json
from jaxlp.evals.kvcache import CacheQuality, evaluate_caches, run_kvcache_eval
from jaxlp.evals.quality import RecipeQuality, evaluate_recipes, run_quality_report
from jaxlp.evals.reasoner import Evaluation, run_evaluation
from jaxlp.evals.reasoner_plan import EvalSettings, describe_plan, resolve_eval_settings
from jaxlp.evals.rowgroups import RowGroupCache, RowGroupSampler
from jaxlp.evals.stats import AccuracySummary, PairedDelta, accuracy_summary, paired_delta, t_interval
from jaxlp.evals.traces import ResetTrace, plot_reset_trace, reset_trace

__all__ = [
    "AccuracySummary", "CacheQuality", "EvalSettings", "Evaluation", "PairedDelta", "RecipeQuality", "ResetTrace",
    "RowGroupCache", "RowGroupSampler", "Timing", "accuracy_summary", "analyse", "describe_plan", "distribution",
    "evaluate_caches", "evaluate_recipes", "paired_delta", "plot_lines", "plot_reset_trace", "reset_trace",
    "resolve_eval_settings", "run_entropy_analysis", "run_evaluation", "run_kvcache_eval", "run_metadata",
    "run_quality_report", "t_interval", "time_call", "write_json",
]
