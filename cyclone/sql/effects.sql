-- A step's fenced transaction (ctx.transaction()): the handler's writes, committed only
-- together with the step's completion, which the lease token fences.

-- name: step_lease_held
-- Whether this attempt still holds its lease, as its transaction begins: a holder whose lease
-- was revoked or reclaimed fails at once rather than doing work that can never commit. A
-- plain read, no row lock: the lease keeper must go on renewing the lease meanwhile.
SELECT 1 AS held FROM cyclone_steps WHERE id = %(step_id)s AND lease_token = %(token)s;
