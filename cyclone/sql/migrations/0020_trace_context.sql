-- Version 20: the W3C trace context current at submit (issue 27, SPEC section 16), kept as
-- its traceparent header; a child run takes its parent's. The supervisor parents each
-- attempt's span to it when tracing is on.

ALTER TABLE cyclone_runs ADD COLUMN trace_parent text;
