-- Leases renewed by the supervisor for its workers (cyclone/supervisor/renewal.py): a worker's
-- own thread cannot renew while its handler holds the GIL, the supervisor's loop always can.

-- name: steps_renew
-- Renew every lease of (step id, token) pairs in one statement: one round trip and one commit
-- for all of a VM's due renewals. Fenced by the token like any write of a holder, so a lease
-- the scanner reclaimed (or a cancel revoked) is not renewed: it is left out of what is
-- returned, and the supervisor asks why (step_revoked). `s.id = ANY` keeps the plan on the
-- primary key, one probe per lease, whatever the statistics say.
UPDATE cyclone_steps s
   SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(ttl)s)
  FROM unnest(%(step_ids)s::bigint[], %(tokens)s::uuid[]) AS l (step_id, token)
 WHERE s.id = ANY (%(step_ids)s::bigint[])
   AND s.id = l.step_id AND s.lease_token = l.token
RETURNING s.id;
