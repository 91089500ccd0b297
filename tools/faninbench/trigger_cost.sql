-- trigger_cost.sql: the fan-in statement trigger's cost per row, without the daemon (the
-- figures in fanin.sql's comment on workqueue_fanin_evt_stmt and doc/design/fanin.md §3.12).
-- It fills an EMPTY queue (it truncates workqueue, fanout and fanin_event) with 20,000 plain
-- rows and 20,000 children in 200 groups of 100, all 'running', and times 64-row UPDATEs
-- (an outcome's size) setting them 'done', plain rows first, then children. Run it several
-- times, on a scratch database with schema.sql applied and nothing else running:
--
--     createdb fx && psql -d fx -f schema.sql
--     for i in 1 2 3; do psql -X -d fx -f tools/faninbench/trigger_cost.sql; done
--
-- "done child" minus "done plain" is what the bookkeeping adds to an outcome per 20,000
-- children; with ALTER TABLE workqueue DISABLE TRIGGER fanin_evt_upd first, the same
-- difference is what the children's wider rows cost alone.
\set QUIET on
\pset format unaligned
\pset tuples_only on
TRUNCATE workqueue, fanout, fanin_event RESTART IDENTITY;
INSERT INTO fanout (fanout_id, parent_id, expected_n) SELECT g, 1000000 + g, 100 FROM generate_series(1, 200) g;
INSERT INTO workqueue (stage, status) SELECT 's1', 'running' FROM generate_series(1, 20000);
INSERT INTO workqueue (stage, status, fanout_id, fanout_seq)
SELECT 's1', 'running', 1 + (i - 1) / 100, (i - 1) % 100 FROM generate_series(1, 20000) i;
VACUUM ANALYZE workqueue;
CREATE FUNCTION pg_temp.finish(lo bigint) RETURNS numeric LANGUAGE plpgsql AS $$
DECLARE
    t0 timestamptz := clock_timestamp();
    i  bigint := lo;
BEGIN
    WHILE i < lo + 20000 LOOP
        UPDATE workqueue SET status = 'done', status_at = now() WHERE workqueue_id >= i AND workqueue_id < i + 64;
        i := i + 64;
    END LOOP;
    RETURN round(extract(epoch FROM clock_timestamp() - t0)::numeric * 1000, 1);
END $$;
SELECT 'done plain (ms)', pg_temp.finish(1);
SELECT 'done child (ms)', pg_temp.finish(20001);
SELECT 'inbox rows, children counted', count(*), sum(d_done) FROM fanin_event;
