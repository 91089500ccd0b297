-- operate.sql: what operators may do to a running system, as SQL functions (pepsi-queue(1)).
--
-- Included at the end of schema.sql (\ir operate.sql); idempotent like it. pepsi-queue and the
-- web console only call these functions, so a person in psql, a cron job or a program in any
-- language gets exactly the same semantics:
--
--   queue_retry, queue_hold, queue_release, queue_cancel, queue_delete   (ids) -> rows
--       (workqueue_id, ok, status, reason): one row per distinct id asked for, in the order
--       given; ok = false is a refusal, with its reason, and that row is left alone.
--   queue_pause, queue_resume   (stage) -> (stage, ok, paused, reason)
--   queue_select (filter, after, limit) -> ids;  queue_list, queue_show, queue_status,
--   queue_shape, queue_errors: what pepsi-queue prints.
--   error_pattern, error_signature: the normalised form of an error text and its short hash.
--
-- A filter is a jsonb object, every key optional: stage, status (one status or several
-- separated by commas), error (substring of state.dispatch_error), signature, older (an
-- interval: rows whose status last changed longer ago), id_from, id_to (inclusive).
--
-- Who writes what (the guards that keep operators, the dispatcher and the stages from
-- overwriting one another; every statement here runs under READ COMMITTED, so PostgreSQL
-- re-checks its WHERE clause against the newest version of a row another transaction changed
-- meanwhile, and a row that no longer qualifies is skipped, never overwritten):
--   - An action changes a row only from the states the transition table allows, tested in the
--     UPDATE's own WHERE clause. The dispatcher's writes are guarded by status = 'running' (and
--     stage and claim), the claim by status = 'pending', the retry flip by status = 'paused', a
--     stage's outcome by status = 'running' AND its stage: none of them matches held or
--     cancelled, so none can overwrite an operator's write; and an operator's write never
--     matches a row that moved on before it (it is refused with the state it found).
--   - Cancelling a running row leaves its claim token alone and notifies the dispatcher
--     (channel workqueue_cancel, payload "TABLE-OID ID:CLAIM ..."): it stops the message's worker if
--     the message is at the head of the worker's queue; otherwise the stage's outcome write,
--     guarded by status = 'running', changes nothing when the stage reaches it.
--   - Every action writes its operator_log row in its own transaction.
--   - An action on many rows holds their row locks until it commits, and the claim (or a
--     stage) that meets one of them waits: callers pass at most a batch of ids per call
--     (pepsi-queue: 1,000), so a wait is a few milliseconds. (A transaction left open on a
--     pending row costs the claim its budget once, then it claims past locked rows: claim.go.
--     The return of due paused rows, the unpark and retention always pass over held rows:
--     retry.go, claim.go, retention.go.)

-- Databases made before held and cancelled existed: widen the status check once.
DO $$
DECLARE
    con text;
BEGIN
    SELECT conname INTO con FROM pg_constraint
     WHERE conrelid = 'workqueue'::regclass AND contype = 'c'
       AND pg_get_constraintdef(oid) LIKE '%status%' AND pg_get_constraintdef(oid) LIKE '%''pending''%'
       AND pg_get_constraintdef(oid) NOT LIKE '%cancelled%';  -- the status list, not a rule on status_at
    IF con IS NOT NULL THEN
        EXECUTE format('ALTER TABLE workqueue DROP CONSTRAINT %I', con);
        ALTER TABLE workqueue ADD CONSTRAINT workqueue_status_check
            CHECK (status IN ('pending', 'running', 'paused', 'waiting', 'done', 'failed',
                              'held', 'cancelled'));
    END IF;
    -- The state-change time, for ages, --older and RETENTION. Rows older than the column keep
    -- NULL (readers fall back to created_at): filling it in would rewrite the table.
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'workqueue'::regclass
                                              AND attname = 'status_at' AND NOT attisdropped) THEN
        ALTER TABLE workqueue ADD COLUMN status_at timestamptz;
        ALTER TABLE workqueue ALTER COLUMN status_at SET DEFAULT now();
    END IF;
END $$;

-- status_at is written by each writer that changes a status, in the same UPDATE: the claim,
-- the dispatcher's failure, reset and retry writes, the stage SDK's outcomes, the fan-in
-- wake and split, and the functions below. Not by a trigger: a BEFORE ROW trigger makes
-- PostgreSQL lock every updated row first, which cost the hot path a WAL record per row
-- (measured: claim 422 -> 495 bytes of WAL per row, outcome 323 -> 387, 20,000 rows), even
-- with a WHEN clause that skips the call. A stage that writes its outcome by hand should set
-- status_at = now() too (pepsi-worker(7)); one that does not leaves its claim time there.
-- Dropped if a draft of this file made it.
DROP TRIGGER IF EXISTS workqueue_status_at ON workqueue;
DROP FUNCTION IF EXISTS workqueue_status_at();

-- The audit trail: one row per action call, written in the action's own transaction.
CREATE TABLE IF NOT EXISTS operator_log (
    id        bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    db_role   text        NOT NULL DEFAULT session_user,  -- the database role that acted
    os_user   text,                                     -- the OS user, when the caller knows it
    action    text        NOT NULL,                     -- retry, retry --reset, hold, ..., pause
    filter    text,                                     -- the selection as the caller gave it
    requested int         NOT NULL,                     -- distinct ids (or stages) asked for
    changed   int         NOT NULL,                     -- rows changed
    ids       bigint[]    NOT NULL DEFAULT '{}',        -- the ids changed
    stage     text                                      -- pause and resume: the stage
);
CREATE INDEX IF NOT EXISTS operator_log_at ON operator_log (at);

------------------------------------------------------------------------------------------
-- Error signatures
------------------------------------------------------------------------------------------

-- error_pattern: the error text with what varies between two occurrences of one cause
-- replaced by placeholders, in this order (each step sees the previous one's output):
--   1. quoted values ('…', "…", `…`)                         -> '?'
--   2. URLs (scheme://…)                                      -> <url>
--   3. e-mail addresses                                       -> <email>
--   4. UUIDs                                                  -> <uuid>
--   5. dates and times (2026-12-02T14:57:01.5Z, 2026-12-02, 14:57:01)  -> <time>
--   6. IPv4 addresses (with an optional :port), IPv6 in [ ]   -> <ip>
--   7. hexadecimal: 0x… and runs of 8 or more hex digits with at least one digit -> <hex>
--   8. durations: a number with a unit (ms, s, m, h, us, µs, ns, min, sec, seconds, …),
--      also chained (1m30s)                                  -> <dur>
--   9. any other number that starts a word (123, 4.5, -7, 5.1.1) -> <n>
--  10. runs of white space                                    -> one space, trimmed
-- The prefix the dispatcher writes, "stage NAME: status N: ", is kept as it is: the status
-- number is the stage's own classification of the failure. A text longer than 2,000
-- characters is cut before normalising. IMMUTABLE: the same text always gives the same
-- pattern, across sessions and versions of this file that keep these rules.
CREATE OR REPLACE FUNCTION error_pattern(p_text text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    prefix text := coalesce(substring(p_text FROM '^stage [a-z0-9_-]+: status [0-9]+(?:: |$)'), '');
    t      text := left(substr(p_text, length(prefix) + 1), 2000);
BEGIN
    IF p_text IS NULL THEN
        RETURN NULL;
    END IF;
    t := regexp_replace(t, $re$'[^']*'|"[^"]*"|`[^`]*`$re$, '''?''', 'g');
    t := regexp_replace(t, '[a-zA-Z][a-zA-Z0-9+.-]*://[^[:space:]]+', '<url>', 'g');
    t := regexp_replace(t, '[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}', '<email>', 'g');
    t := regexp_replace(t, '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}', '<uuid>', 'g');
    t := regexp_replace(t, '[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}([.,][0-9]+)?)?)?(Z|[+-][0-9]{2}(:?[0-9]{2})?)?', '<time>', 'g');
    t := regexp_replace(t, '\m[0-9]{1,2}:[0-9]{2}:[0-9]{2}([.,][0-9]+)?', '<time>', 'g');
    t := regexp_replace(t, '\m[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}(:[0-9]+)?', '<ip>', 'g');
    t := regexp_replace(t, '\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](:[0-9]+)?', '<ip>', 'g');
    t := regexp_replace(t, '\m0[xX][0-9a-fA-F]+\M', '<hex>', 'g');
    t := regexp_replace(t, '\m(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\M', '<hex>', 'g');
    t := regexp_replace(t, '(^|[^[:alnum:]_.])-?([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|sec|secs|seconds?|m|min|mins|minutes?|h|hours?|d|days?))+\M', '\1<dur>', 'g');
    t := regexp_replace(t, '(^|[^[:alnum:]_.])-?[0-9]+(\.[0-9]+)*\M', '\1<n>', 'g');
    t := btrim(regexp_replace(t, '[[:space:]]+', ' ', 'g'));
    RETURN prefix || t;
END $$;

-- error_signature: the first 12 hex digits of the MD5 of the pattern; what `errors` prints
-- and `--signature` takes. NULL for a NULL text.
CREATE OR REPLACE FUNCTION error_signature(p_text text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT left(md5(error_pattern(p_text)), 12)
$$;

------------------------------------------------------------------------------------------
-- Selection
------------------------------------------------------------------------------------------

-- queue_match: whether row w passes filter f (see the header). With a signature and no
-- status, the statuses are those `errors` groups by default: failed and paused.
-- It has no SET clause, unlike every other function here, so that PostgreSQL inlines it into
-- the statement that calls it (queue_select, queue_errors), whose own SET search_path then
-- resolves its names: a function with one is called row by row, about 6 µs each, and a
-- selection that walks the table ("--signature", "--error", "--status pending") took 26 s on
-- 4 million rows, against 0.6 s inlined. It is not meant to be called on its own.
CREATE OR REPLACE FUNCTION queue_match(w workqueue, f jsonb) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (f->>'stage' IS NULL OR w.stage = f->>'stage')
       AND (CASE WHEN f->>'status' IS NOT NULL
                 THEN w.status = ANY (string_to_array(replace(f->>'status', ' ', ''), ','))
                 WHEN f->>'signature' IS NOT NULL THEN w.status IN ('failed', 'paused')
                 ELSE true END)
       AND (f->>'error' IS NULL OR strpos(w.state->>'dispatch_error', f->>'error') > 0)
       AND (f->>'signature' IS NULL OR error_signature(w.state->>'dispatch_error') = f->>'signature')
       AND (f->>'older' IS NULL OR coalesce(w.status_at, w.created_at) < now() - (f->>'older')::interval)
       AND (f->>'id_from' IS NULL OR w.workqueue_id >= (f->>'id_from')::bigint)
       AND (f->>'id_to' IS NULL OR w.workqueue_id <= (f->>'id_to')::bigint)
$$;

-- queue_select_statuses: the statuses a filter keeps its rows to, by queue_match's rule (its
-- status list; failed and paused for a signature), or p_any when it keeps any (NULL).
CREATE OR REPLACE FUNCTION queue_select_statuses(p_filter jsonb, p_any text[] DEFAULT NULL)
RETURNS text[] LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_filter->>'status' IS NOT NULL
                THEN string_to_array(replace(p_filter->>'status', ' ', ''), ',')
                WHEN p_filter->>'signature' IS NOT NULL THEN '{failed,paused}'::text[]
                ELSE p_any
           END
$$;

-- queue_select: the ids passing the filter, after p_after, in id order, at most p_limit: page
-- through a large selection by passing the last id back as p_after. The failed, paused, held
-- and cancelled rows a filter keeps to are read in id order from their own index
-- (workqueue_stopped: one index scan per status asked for, the LATERAL), the others from the
-- primary key, that branch decided once per call:
-- a page of "--status failed" was a walk of the table until it had found p_limit failed rows,
-- all of it for the last page (and for every page when they are sparse). jit = off: a page
-- gains nothing from it, and a branch's estimate can reach its thresholds.
CREATE OR REPLACE FUNCTION queue_select(p_filter jsonb DEFAULT '{}', p_after bigint DEFAULT 0,
                                        p_limit int DEFAULT 1000)
RETURNS SETOF bigint LANGUAGE sql STABLE SET search_path FROM CURRENT SET jit = off AS $$
    SELECT s.workqueue_id FROM (
        SELECT b.workqueue_id
          FROM unnest('{failed,paused,held,cancelled}'::text[]) st(status)
         CROSS JOIN LATERAL (
            SELECT w.workqueue_id FROM workqueue w
             WHERE w.status = st.status AND w.status IN ('failed', 'paused', 'held', 'cancelled')
               AND w.workqueue_id > p_after
               AND w.workqueue_id >= coalesce((p_filter->>'id_from')::bigint, 0)
               AND w.workqueue_id <= coalesce((p_filter->>'id_to')::bigint, 9223372036854775807)
               AND queue_match(w, coalesce(p_filter, '{}'))
             ORDER BY w.workqueue_id LIMIT p_limit) b
         WHERE st.status = ANY (queue_select_statuses(p_filter))
        UNION ALL
        (SELECT w.workqueue_id FROM workqueue w
          WHERE (queue_select_statuses(p_filter) IS NULL
                 OR NOT queue_select_statuses(p_filter) <@ '{failed,paused,held,cancelled}')
            AND (queue_select_statuses(p_filter) IS NULL
                 OR w.status NOT IN ('failed', 'paused', 'held', 'cancelled'))
            AND w.workqueue_id > p_after
            AND w.workqueue_id >= coalesce((p_filter->>'id_from')::bigint, 0)
            AND w.workqueue_id <= coalesce((p_filter->>'id_to')::bigint, 9223372036854775807)
            AND queue_match(w, coalesce(p_filter, '{}'))
          ORDER BY w.workqueue_id LIMIT p_limit)
    ) s
     ORDER BY s.workqueue_id
     LIMIT p_limit
$$;

------------------------------------------------------------------------------------------
-- Actions
------------------------------------------------------------------------------------------

-- The actions by id run with enable_seqscan = off: every statement in them finds its rows by
-- key, but plpgsql keeps a generic plan after five calls, planned for the table as it was
-- then, and a long-lived session (the console's pool) that acted on a small table went on
-- scanning it whole once it had grown (TestOperatePlansStaleStatistics; the split functions
-- had the same fault, fanin.sql). And with jit = off: a statement that no index serves would
-- otherwise be costed at 10^10 and compiled (fanin.sql, the coordinator's side).

-- The result of an action for the ids asked for: changed ones (ok) with their new status,
-- the others refused with the state they were found in, or with what the database said when
-- it refused the row's change by itself (p_refused, from queue_apply).
-- The function gained p_refused: the earlier version is dropped first (a call with five
-- arguments would match both).
DROP FUNCTION IF EXISTS queue_result(text, bigint[], bigint[], text[], text);
CREATE OR REPLACE FUNCTION queue_result(p_action text, p_ids bigint[], p_changed bigint[],
                                        p_from text[], p_new text, p_refused jsonb DEFAULT '{}')
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT r.id,
           r.id = ANY (p_changed),
           CASE WHEN r.id = ANY (p_changed) THEN p_new ELSE w.status END,
           CASE WHEN r.id = ANY (p_changed) THEN NULL
                WHEN w.workqueue_id IS NULL THEN 'no such message'
                WHEN p_refused ? r.id::text
                     THEN 'the database refused the change: ' || (p_refused ->> r.id::text)
                WHEN w.status = ANY (p_from) AND w.fanout_id IS NOT NULL AND p_action = 'delete'
                     THEN format('is a child of fan-out group %s, which has not completed', w.fanout_id)
                WHEN w.status = ANY (p_from) AND w.wait_fanout_id IS NOT NULL
                     THEN format('waits on fan-out group %s, which has not completed', w.wait_fanout_id)
                WHEN w.status = ANY (p_from) THEN 'changed meanwhile; try again'
                ELSE format('is %s: %s acts on %s messages', w.status, p_action,
                            array_to_string(p_from, ', '))
           END
      FROM (SELECT id, min(n) AS n FROM unnest(p_ids) WITH ORDINALITY AS u(id, n) GROUP BY id) r
      LEFT JOIN workqueue w ON w.workqueue_id = r.id
     ORDER BY r.n
$$;

DROP FUNCTION IF EXISTS queue_log(text, text, text, bigint[], bigint[], text); -- a draft's form

-- queue_log writes the action's operator_log row. Pause and resume pass their stage and
-- whether the stage's PAUSED value changed (p_n) instead of ids.
CREATE OR REPLACE FUNCTION queue_log(p_action text, p_actor text, p_filter text, p_ids bigint[],
                                     p_changed bigint[], p_stage text DEFAULT NULL, p_n int DEFAULT NULL)
RETURNS void LANGUAGE sql SET search_path FROM CURRENT AS $$
    INSERT INTO operator_log (os_user, action, filter, requested, changed, ids, stage)
    VALUES (p_actor, p_action, p_filter,
            CASE WHEN p_stage IS NULL THEN (SELECT count(DISTINCT i) FROM unnest(p_ids) i) ELSE 1 END,
            coalesce(p_n, cardinality(p_changed)), p_changed, p_stage)
$$;

-- Whether message w waits on (or is a child of) a fan-out group that has not fired.
CREATE OR REPLACE FUNCTION queue_group_open(p_fanout bigint) RETURNS boolean
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT p_fanout IS NOT NULL
       AND EXISTS (SELECT 1 FROM fanout f WHERE f.fanout_id = p_fanout AND f.state = 'open')
$$;

-- queue_rows (internal) is an action's write to the rows p_ids, from the states its transition
-- allows (the actions below say which): it returns the ids changed and, for cancel, the
-- running ones as "id:claim" (running).
CREATE OR REPLACE FUNCTION queue_rows(p_action text, p_ids bigint[], p_reset boolean,
    OUT changed bigint[], OUT running text[])
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
BEGIN
    running := '{}';
    CASE p_action
    WHEN 'retry' THEN
        WITH u AS (
            UPDATE workqueue w SET status = 'pending', retry_at = NULL, status_at = now(),
                                   attempts = CASE WHEN p_reset THEN 0 ELSE w.attempts END
             WHERE w.workqueue_id = ANY (p_ids)
               AND w.status IN ('failed', 'cancelled', 'paused', 'held')
               AND NOT queue_group_open(w.wait_fanout_id)
            RETURNING w.workqueue_id)
        SELECT coalesce(array_agg(u.workqueue_id), '{}') INTO changed FROM u;
    WHEN 'hold' THEN
        WITH u AS (
            UPDATE workqueue w SET status = 'held', retry_at = NULL, status_at = now()
             WHERE w.workqueue_id = ANY (p_ids) AND w.status IN ('pending', 'paused')
            RETURNING w.workqueue_id)
        SELECT coalesce(array_agg(u.workqueue_id), '{}') INTO changed FROM u;
    WHEN 'release' THEN
        WITH u AS (
            UPDATE workqueue w SET status = 'pending', status_at = now()
             WHERE w.workqueue_id = ANY (p_ids) AND w.status = 'held'
            RETURNING w.workqueue_id)
        SELECT coalesce(array_agg(u.workqueue_id), '{}') INTO changed FROM u;
    WHEN 'cancel' THEN
        WITH u AS (
            UPDATE workqueue w SET status = 'cancelled', retry_at = NULL, status_at = now(),
                                   claimed_at = CASE WHEN w.status = 'running' THEN w.claimed_at END
             WHERE w.workqueue_id = ANY (p_ids)
               AND w.status IN ('pending', 'paused', 'held', 'waiting', 'running')
            RETURNING w.workqueue_id, w.claim, w.claimed_at IS NOT NULL AS was_running)
        SELECT coalesce(array_agg(u.workqueue_id), '{}'),
               coalesce(array_agg(u.workqueue_id || ':' || u.claim) FILTER (WHERE u.was_running), '{}')
          INTO changed, running FROM u;
    WHEN 'delete' THEN
        WITH u AS (
            DELETE FROM workqueue w
             WHERE w.workqueue_id = ANY (p_ids) AND w.status IN ('done', 'failed', 'cancelled')
               AND NOT queue_group_open(w.fanout_id)
            RETURNING w.workqueue_id)
        SELECT coalesce(array_agg(u.workqueue_id), '{}') INTO changed FROM u;
    END CASE;
END $$;

-- queue_apply (internal) runs an action's write (queue_rows) on p_ids in one statement, and
-- when the database refuses it by itself (an integrity error, SQLSTATE class 23, or a raised
-- exception, class P0: an application's trigger, CHECK constraint or foreign key that will
-- not let one row change) on each half of the ids again, down to single rows (queue_halves):
-- the refused rows are left as they were and returned in refused (id -> what the database
-- said), the others changed. Before, one such row refused its whole call: pepsi-queue's batch
-- of 1,000 and every batch after it, the console's whole action (TestOperateActionRefusedRow).
CREATE OR REPLACE FUNCTION queue_apply(p_action text, p_ids bigint[], p_reset boolean DEFAULT false,
    OUT changed bigint[], OUT running text[], OUT refused jsonb)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    SELECT * INTO changed, running, refused
      FROM queue_halves(p_action, ARRAY(SELECT DISTINCT x FROM unnest(p_ids) AS x ORDER BY x),
                        p_reset, '{}', '{}', '{}');
END $$;

-- queue_halves (internal) runs queue_rows on p_ids in a subtransaction and, when the database
-- refuses it by itself, on each half of p_ids, down to one row, whose refusal it adds to
-- refused; what changes it adds to changed and running. Halving opens about 2 log2(n)
-- subtransactions per refused row where one per row would open n: past 64, a backend's
-- subtransactions overflow its cache, and every other session's snapshots are slower until it
-- commits (the Go SDK bounds its own, stage/batch.go's maxSubxids, for the same reason).
CREATE OR REPLACE FUNCTION queue_halves(p_action text, p_ids bigint[], p_reset boolean,
    INOUT changed bigint[], INOUT running text[], INOUT refused jsonb)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    r    record;
    msg  text;
    half int;
BEGIN
    IF cardinality(p_ids) = 0 THEN
        RETURN;
    END IF;
    BEGIN
        SELECT * INTO r FROM queue_rows(p_action, p_ids, p_reset);
        changed := changed || r.changed;
        running := running || r.running;
        RETURN;
    EXCEPTION WHEN integrity_constraint_violation OR plpgsql_error THEN
        GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT; -- rolled back to the block's start
    END;
    IF cardinality(p_ids) = 1 THEN
        refused := refused || jsonb_build_object(p_ids[1]::text, msg);
        RETURN;
    END IF;
    half := cardinality(p_ids) / 2;
    SELECT * INTO changed, running, refused
      FROM queue_halves(p_action, p_ids[1:half], p_reset, changed, running, refused);
    SELECT * INTO changed, running, refused
      FROM queue_halves(p_action, p_ids[half + 1:], p_reset, changed, running, refused);
END $$;

-- queue_retry: failed, cancelled, paused or held -> pending, attempts kept (p_reset: set to
-- 0). A parent whose fan-out group has not completed is refused (it would run its
-- continuation before its children finished).
CREATE OR REPLACE FUNCTION queue_retry(p_ids bigint[], p_reset boolean DEFAULT false,
                                       p_actor text DEFAULT NULL, p_filter text DEFAULT NULL)
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    a record;
BEGIN
    SELECT * INTO a FROM queue_apply('retry', p_ids, p_reset);
    PERFORM queue_log(CASE WHEN p_reset THEN 'retry --reset' ELSE 'retry' END,
                      p_actor, p_filter, p_ids, a.changed);
    RETURN QUERY SELECT * FROM queue_result('retry', p_ids, a.changed,
                                            '{failed,cancelled,paused,held}', 'pending', a.refused);
END $$;

-- queue_hold: pending or paused -> held; attempts and error kept.
CREATE OR REPLACE FUNCTION queue_hold(p_ids bigint[], p_actor text DEFAULT NULL,
                                      p_filter text DEFAULT NULL)
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    a record;
BEGIN
    SELECT * INTO a FROM queue_apply('hold', p_ids);
    PERFORM queue_log('hold', p_actor, p_filter, p_ids, a.changed);
    RETURN QUERY SELECT * FROM queue_result('hold', p_ids, a.changed, '{pending,paused}', 'held', a.refused);
END $$;

-- queue_release: held -> pending (at once, whatever retry time the row had before).
CREATE OR REPLACE FUNCTION queue_release(p_ids bigint[], p_actor text DEFAULT NULL,
                                         p_filter text DEFAULT NULL)
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    a record;
BEGIN
    SELECT * INTO a FROM queue_apply('release', p_ids);
    PERFORM queue_log('release', p_actor, p_filter, p_ids, a.changed);
    RETURN QUERY SELECT * FROM queue_result('release', p_ids, a.changed, '{held}', 'pending', a.refused);
END $$;

-- queue_cancel: pending, paused, held, waiting or running -> cancelled. The SET clause is
-- evaluated on the newest version of each row, so it knows which rows were running when they
-- were cancelled: those keep claimed_at (the others' is cleared) and are named to the
-- dispatcher, which stops their workers (see the header). A cancelled waiting parent is not
-- woken when its group completes (fanin_wake_log.parent_woken = false); its children go on.
CREATE OR REPLACE FUNCTION queue_cancel(p_ids bigint[], p_actor text DEFAULT NULL,
                                        p_filter text DEFAULT NULL)
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    a record;
    i int;
BEGIN
    SELECT * INTO a FROM queue_apply('cancel', p_ids);
    -- The payload names the system by its table's oid (the dispatcher's lock key: NOTIFY
    -- channels are per database, not per schema) and each message by id:claim, so that the
    -- dispatcher stops the worker of that claim only. Under 8,000 bytes: 300 at a time.
    FOR i IN 0 .. (cardinality(a.running) - 1) / 300 LOOP
        EXIT WHEN cardinality(a.running) = 0;
        PERFORM pg_notify('workqueue_cancel',
                          'workqueue'::regclass::oid::bigint || ' '
                          || array_to_string(a.running[i * 300 + 1 : i * 300 + 300], ' '));
    END LOOP;
    PERFORM queue_log('cancel', p_actor, p_filter, p_ids, a.changed);
    RETURN QUERY SELECT * FROM queue_result('cancel', p_ids, a.changed,
                                            '{pending,paused,held,waiting,running}', 'cancelled', a.refused);
END $$;

-- queue_delete: done, failed or cancelled -> removed. A child of a fan-out group that has not
-- completed is refused (its parent still needs it).
CREATE OR REPLACE FUNCTION queue_delete(p_ids bigint[], p_actor text DEFAULT NULL,
                                        p_filter text DEFAULT NULL)
RETURNS TABLE (workqueue_id bigint, ok boolean, status text, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    a record;
BEGIN
    SELECT * INTO a FROM queue_apply('delete', p_ids);
    PERFORM queue_log('delete', p_actor, p_filter, p_ids, a.changed);
    RETURN QUERY SELECT * FROM queue_result('delete', p_ids, a.changed, '{done,failed,cancelled}', NULL, a.refused);
END $$;

-- queue_pause / queue_resume: the config overlay row PAUSED = yes / no in [stage-NAME]; the
-- config_changed notification makes the dispatcher stop (or start) claiming for that stage
-- at once. A row survives a restart. Resume writes 'no' rather than deleting the row, so it
-- also overrides a PAUSED = yes in the configuration file.
CREATE OR REPLACE FUNCTION queue_pause(p_stage text, p_paused boolean DEFAULT true,
                                       p_actor text DEFAULT NULL)
RETURNS TABLE (stage text, ok boolean, paused boolean, reason text)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    was boolean;
BEGIN
    IF p_stage IS NULL OR p_stage !~ '^[a-z0-9_-]+$' THEN
        PERFORM queue_log(CASE WHEN p_paused THEN 'pause' ELSE 'resume' END, p_actor, NULL,
                          '{}', '{}', coalesce(p_stage, ''), 0);
        RETURN QUERY SELECT p_stage, false, NULL::boolean, 'stage names are [a-z0-9_-]+';
        RETURN;
    END IF;
    SELECT lower(c.value) IN ('yes', 'true', 'on', '1') INTO was
      FROM config c WHERE c.section = 'stage-' || p_stage AND c.key = 'PAUSED';
    INSERT INTO config (section, key, value)
    VALUES ('stage-' || p_stage, 'PAUSED', CASE WHEN p_paused THEN 'yes' ELSE 'no' END)
    ON CONFLICT (section, key) DO UPDATE SET value = EXCLUDED.value
     WHERE config.value IS DISTINCT FROM EXCLUDED.value;
    PERFORM queue_log(CASE WHEN p_paused THEN 'pause' ELSE 'resume' END, p_actor, NULL,
                      '{}', '{}', p_stage, (coalesce(was, false) IS DISTINCT FROM p_paused)::int);
    RETURN QUERY SELECT p_stage, true, p_paused, NULL::text;
END $$;

CREATE OR REPLACE FUNCTION queue_resume(p_stage text, p_actor text DEFAULT NULL)
RETURNS TABLE (stage text, ok boolean, paused boolean, reason text)
LANGUAGE sql SET search_path FROM CURRENT AS $$
    SELECT * FROM queue_pause(p_stage, false, p_actor)
$$;

------------------------------------------------------------------------------------------
-- What pepsi-queue prints
------------------------------------------------------------------------------------------

-- queue_paused_stages: the stages the overlay pauses.
CREATE OR REPLACE FUNCTION queue_paused_stages() RETURNS SETOF text
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT substr(c.section, 7) FROM config c
     WHERE c.section LIKE 'stage-%' AND c.key = 'PAUSED'
       AND lower(c.value) IN ('yes', 'true', 'on', '1')
$$;

-- queue_status: one row per stage (those with messages, and paused ones), then the totals
-- (stage NULL). oldest_pending: the age of the stage's oldest pending message.
CREATE OR REPLACE FUNCTION queue_status()
RETURNS TABLE (stage text, pending bigint, running bigint, paused bigint, waiting bigint,
               held bigint, done bigint, failed bigint, cancelled bigint, total bigint,
               oldest_pending interval, stage_paused boolean)
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    WITH c AS (
        SELECT w.stage, w.status, count(*) AS n,
               min(coalesce(w.status_at, w.created_at)) FILTER (WHERE w.status = 'pending') AS oldest
          FROM workqueue w GROUP BY w.stage, w.status
    ), s AS (
        SELECT c.stage FROM c UNION SELECT queue_paused_stages()
    ), per AS (
        SELECT s.stage,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'pending'), 0)::bigint   AS pending,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'running'), 0)::bigint   AS running,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'paused'), 0)::bigint    AS paused,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'waiting'), 0)::bigint   AS waiting,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'held'), 0)::bigint      AS held,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'done'), 0)::bigint      AS done,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'failed'), 0)::bigint    AS failed,
               coalesce(sum(c.n) FILTER (WHERE c.status = 'cancelled'), 0)::bigint AS cancelled,
               coalesce(sum(c.n), 0)::bigint AS total,
               now() - min(c.oldest) AS oldest_pending,
               s.stage IN (SELECT queue_paused_stages()) AS stage_paused
          FROM s LEFT JOIN c ON c.stage = s.stage
         GROUP BY s.stage
    )
    SELECT * FROM (SELECT * FROM per ORDER BY per.stage) p
    UNION ALL
    SELECT NULL, sum(pending)::bigint, sum(running)::bigint, sum(paused)::bigint,
           sum(waiting)::bigint, sum(held)::bigint, sum(done)::bigint, sum(failed)::bigint,
           sum(cancelled)::bigint, sum(total)::bigint, max(oldest_pending), bool_or(stage_paused)
      FROM per
$$;

-- queue_shape: messages per stage by the age of their last state change, like qshape. The
-- buckets: [0, 1m) [1m, 5m) [5m, 10m) [10m, 30m) [30m, 1h) [1h, 4h) [4h, 1d) [1d, 2d) [2d, ...).
-- Without p_status: the messages not yet finished (pending, running, paused, waiting, held).
CREATE OR REPLACE FUNCTION queue_shape(p_stage text DEFAULT NULL, p_status text DEFAULT NULL)
RETURNS TABLE (stage text, total bigint, lt_1m bigint, age_1m bigint, age_5m bigint,
               age_10m bigint, age_30m bigint, age_1h bigint, age_4h bigint, age_1d bigint,
               gt_1d bigint)
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    WITH a AS (
        SELECT w.stage, extract(epoch FROM now() - coalesce(w.status_at, w.created_at)) AS s
          FROM workqueue w
         WHERE (p_stage IS NULL OR w.stage = p_stage)
           AND (CASE WHEN p_status IS NULL THEN w.status IN ('pending', 'running', 'paused', 'waiting', 'held')
                     ELSE w.status = ANY (string_to_array(replace(p_status, ' ', ''), ',')) END)
    ), per AS (
        SELECT a.stage, count(*) AS total,
               count(*) FILTER (WHERE s < 60) AS b0,
               count(*) FILTER (WHERE s >= 60 AND s < 300) AS b1,
               count(*) FILTER (WHERE s >= 300 AND s < 600) AS b2,
               count(*) FILTER (WHERE s >= 600 AND s < 1800) AS b3,
               count(*) FILTER (WHERE s >= 1800 AND s < 3600) AS b4,
               count(*) FILTER (WHERE s >= 3600 AND s < 14400) AS b5,
               count(*) FILTER (WHERE s >= 14400 AND s < 86400) AS b6,
               count(*) FILTER (WHERE s >= 86400 AND s < 172800) AS b7,
               count(*) FILTER (WHERE s >= 172800) AS b8
          FROM a GROUP BY a.stage
    )
    SELECT * FROM (SELECT * FROM per ORDER BY 1) p
    UNION ALL
    SELECT NULL, sum(per.total)::bigint, sum(b0)::bigint, sum(b1)::bigint, sum(b2)::bigint,
           sum(b3)::bigint, sum(b4)::bigint, sum(b5)::bigint, sum(b6)::bigint, sum(b7)::bigint,
           sum(b8)::bigint
      FROM per
$$;

-- queue_list: one row per message passing the filter, in id order, after p_after.
CREATE OR REPLACE FUNCTION queue_list(p_filter jsonb DEFAULT '{}', p_limit int DEFAULT 100,
                                      p_after bigint DEFAULT 0)
RETURNS TABLE (workqueue_id bigint, stage text, status text, attempts int, age interval,
               status_at timestamptz, retry_at timestamptz, dispatch_error text)
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT w.workqueue_id, w.stage, w.status, w.attempts,
           now() - coalesce(w.status_at, w.created_at), coalesce(w.status_at, w.created_at),
           w.retry_at, w.state->>'dispatch_error'
      FROM workqueue w
     WHERE w.workqueue_id IN (SELECT queue_select(p_filter, p_after, p_limit))
     ORDER BY w.workqueue_id
$$;

-- queue_show: each row whole, as JSON (the table's columns), with its error's signature and
-- its fan-out group (the one it belongs to, or the one it waits on) when it has one.
CREATE OR REPLACE FUNCTION queue_show(p_ids bigint[])
RETURNS TABLE (workqueue_id bigint, message jsonb)
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT w.workqueue_id,
           to_jsonb(w)
           || jsonb_build_object('error_signature', error_signature(w.state->>'dispatch_error'),
                                 'fanout', (SELECT to_jsonb(f) FROM fanout f
                                             WHERE f.fanout_id = coalesce(w.fanout_id, w.wait_fanout_id)))
      FROM workqueue w
     WHERE w.workqueue_id = ANY (p_ids)
     ORDER BY array_position(p_ids, w.workqueue_id)
$$;

-- queue_errors: failures grouped by signature, largest group first. Without a status in the
-- filter: failed and paused rows (paused: failed at least once, will be retried). first_seen
-- and last_seen: the earliest and latest state change of the group's rows; example: the most
-- recent row of the group.
CREATE OR REPLACE FUNCTION queue_errors(p_filter jsonb DEFAULT '{}')
RETURNS TABLE (signature text, count bigint, stages text[], first_seen timestamptz,
               last_seen timestamptz, example_id bigint, example_error text, pattern text)
LANGUAGE sql STABLE SET search_path FROM CURRENT SET jit = off AS $$
    WITH r AS (
        -- The statuses asked for (without a status in the filter: failed and paused), each
        -- of failed, paused, held and cancelled through the partial index of their rows
        -- (workqueue_stopped: an index scan per status, the LATERAL), any other from the
        -- whole table, a branch decided once per call. The console's failures page runs this
        -- at every load, and it was one scan of the table, done rows and all (0.9 s on 4
        -- million rows; past the console's 3-second statement timeout with a few tens of
        -- millions). The table-wide branch's estimate put every call past JIT's thresholds
        -- (about 250 ms of compiling for a few thousand rows): jit = off.
        SELECT b.*
          FROM unnest('{failed,paused,held,cancelled}'::text[]) st(status)
         CROSS JOIN LATERAL (
            SELECT w.workqueue_id, w.stage, coalesce(w.status_at, w.created_at) AS at,
                   w.state->>'dispatch_error' AS err
              FROM workqueue w
             WHERE w.status = st.status AND w.status IN ('failed', 'paused', 'held', 'cancelled')
               AND w.state ? 'dispatch_error' AND queue_match(w, coalesce(p_filter, '{}'))) b
         WHERE st.status = ANY (queue_select_statuses(p_filter, '{failed,paused}'))
        UNION ALL
        SELECT w.workqueue_id, w.stage, coalesce(w.status_at, w.created_at), w.state->>'dispatch_error'
          FROM workqueue w
         WHERE NOT queue_select_statuses(p_filter, '{failed,paused}')
                   <@ '{failed,paused,held,cancelled}'
           AND w.status NOT IN ('failed', 'paused', 'held', 'cancelled')
           AND w.state ? 'dispatch_error' AND queue_match(w, coalesce(p_filter, '{}'))
    ), f AS (
        SELECT r.*, error_signature(r.err) AS sig FROM r
    )
    SELECT f.sig, count(*), array_agg(DISTINCT f.stage ORDER BY f.stage), min(f.at), max(f.at),
           (array_agg(f.workqueue_id ORDER BY f.at DESC, f.workqueue_id DESC))[1],
           (array_agg(f.err ORDER BY f.at DESC, f.workqueue_id DESC))[1],
           error_pattern((array_agg(f.err ORDER BY f.at DESC, f.workqueue_id DESC))[1])
      FROM f GROUP BY f.sig
     ORDER BY count(*) DESC, f.sig
$$;
