"""The search: the layouts worth considering over a set of live workers
(``layouts.Search``: stage shapes, templates of balanced splits (``template``), their
placement and estimates), and a brute-force ``reference`` the tests hold it to. Imports
the job, plans and the estimator."""
