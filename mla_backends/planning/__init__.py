"""Sizing and measuring deployments: the cost model (``costs``), the roofline of one decode call (``roofline``),
deployment sizing (``deployment``), the memory an engine holds back (``reserve``) and the measured
absorbed/expanded crossover (``tuning``, what ``mla-backends tune`` runs).

Imports: anything below; nothing imports it but the CLI and the tests.
"""
