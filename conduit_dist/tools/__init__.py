"""Tools users run on a job: ``info`` (``python -m conduit_dist info``) and the report
(``python -m conduit_dist.report``)."""
