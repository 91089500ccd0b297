// pgq.go: PgQ (Debian's postgresql-15-pgq3, ticker pgqd) as a system under test, for W1, W2
// and W3 as context: events are inserted with pgq.insert_event, pgqd cuts them into batches
// (ticks), and a batch consumer, `pipeline sut pgq`, takes each batch, reads its events and
// acknowledges it with pgq.finish_batch, in one transaction per batch. pgqd runs as that
// process's child, so its CPU is counted with the consumer's.
//
// PgQ keeps no state per event: what the consumer has consumed is counted in
// bench_pgq_progress, in the batch's transaction, and what was produced by the benchmark.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

const (
	pgqQueue    = "bench"
	pgqConsumer = "bench"
	// The consumer's wait after next_batch found no batch: short, so that its latency is the
	// ticker's (pgqd's ticker_period 1 s; a tick once 500 events or 3 s of lag have gathered,
	// PgQ's queue defaults), not its own.
	pgqIdleDelay = 20 * time.Millisecond
)

const (
	pgqInsertManySQL = `SELECT count(pgq.insert_event('bench', 'msg', g::text)) FROM generate_series($1::bigint, $2::bigint) g`
	pgqInsertSQL     = `SELECT pgq.insert_event('bench', 'msg', $1::bigint::text)`
	pgqConsumedSQL   = `SELECT consumed FROM bench_pgq_progress WHERE id = 1`
)

// setupPgq installs the extension (the private cluster runs PostgreSQL 15 from
// /usr/lib/postgresql/15, where Debian's package puts it) and the progress table.
func setupPgq(ctx context.Context, s *system) error {
	if _, err := exec.LookPath("pgqd"); err != nil {
		return fmt.Errorf("pgq: PgQ needs pgqd and the extension (Debian: apt-get install postgresql-15-pgq3 pgqd), or leave pgq out of -systems: %w", err)
	}
	err := execScript(ctx, s.pool, `CREATE EXTENSION IF NOT EXISTS pgq;
CREATE TABLE IF NOT EXISTS bench_pgq_progress (id int PRIMARY KEY, consumed bigint NOT NULL);
INSERT INTO bench_pgq_progress VALUES (1, 0) ON CONFLICT (id) DO NOTHING;`)
	if err != nil {
		return fmt.Errorf("install pgq in %s: %w", s.dbname, err)
	}
	return s.resetPgq(ctx)
}

// pgqVersion names the extension's and the ticker's versions, for the report.
func pgqVersion(ctx context.Context, s *system) string {
	var v string
	if err := s.pool.QueryRow(ctx, `SELECT extversion FROM pg_extension WHERE extname = 'pgq'`).Scan(&v); err != nil {
		return "PgQ (version unknown)"
	}
	out := "PgQ " + v
	if t, err := exec.CommandContext(ctx, "pgqd", "-V").CombinedOutput(); err == nil {
		out += " with " + strings.TrimSpace(string(t))
	}
	return out
}

// resetPgq starts from an empty queue: drop it, create it, register the consumer (which then
// sees every event inserted after this), and zero the counts.
func (s *system) resetPgq(ctx context.Context) error {
	err := execScript(ctx, s.pool, `SELECT pgq.unregister_consumer('bench', 'bench') FROM pgq.queue WHERE queue_name = 'bench';
SELECT pgq.drop_queue('bench') FROM pgq.queue WHERE queue_name = 'bench';
SELECT pgq.create_queue('bench');
SELECT pgq.register_consumer('bench', 'bench');
UPDATE bench_pgq_progress SET consumed = 0;`)
	if err != nil {
		return fmt.Errorf("reset the pgq queue: %w", err)
	}
	if _, err := s.pool.Exec(ctx, "VACUUM ANALYZE bench_pgq_progress"); err != nil {
		return fmt.Errorf("reset the pgq queue: %w", err)
	}
	s.produced.Store(0)
	return nil
}

// runPgq is `pipeline sut pgq`: pgqd as a child, and the batch consumer on one connection.
// With stamps on (latency runs), each batch's transaction also sends NOTIFY bench_done with
// the batch's messages, delivered at its commit, as the other systems' done triggers do.
func runPgq(ctx context.Context, dsn string, st *stamps) error {
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	ticker, err := startPgqd(dsn)
	if err != nil {
		return err
	}
	defer ticker.stop()
	fmt.Println("ready")
	for ctx.Err() == nil {
		n, err := pgqBatch(ctx, conn, st)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			return err
		}
		if n == 0 {
			select {
			case <-ctx.Done():
			case <-ticker.exited:
				return fmt.Errorf("pgqd exited: %v", ticker.err)
			case <-time.After(pgqIdleDelay):
			}
		}
	}
	return nil
}

// pgqBatch takes the next batch, if there is one, reads its events, counts them and finishes
// it, in one transaction; it returns how many events the batch had (0: no batch).
func pgqBatch(ctx context.Context, conn *pgx.Conn, st *stamps) (int, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.Background()) // a no-op after Commit
	var batch *int64
	if err := tx.QueryRow(ctx, `SELECT pgq.next_batch($1, $2)`, pgqQueue, pgqConsumer).Scan(&batch); err != nil {
		return 0, fmt.Errorf("next_batch: %w", err)
	}
	if batch == nil {
		return 0, tx.Commit(ctx)
	}
	rows, err := tx.Query(ctx, `SELECT ev_data FROM pgq.get_batch_events($1)`, *batch)
	if err != nil {
		return 0, fmt.Errorf("get_batch_events: %w", err)
	}
	var msgs []string
	for rows.Next() {
		var d string
		if err := rows.Scan(&d); err != nil {
			rows.Close()
			return 0, fmt.Errorf("get_batch_events: %w", err)
		}
		msgs = append(msgs, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("get_batch_events: %w", err)
	}
	if st.on {
		for _, m := range msgs {
			if k, err := strconv.ParseInt(m, 10, 64); err == nil {
				st.record(k)
			}
		}
		for _, payload := range chunkJoin(msgs, 7000) { // NOTIFY payloads stop at 8000 bytes
			if _, err := tx.Exec(ctx, `SELECT pg_notify('bench_done', $1)`, payload); err != nil {
				return 0, fmt.Errorf("notify: %w", err)
			}
		}
	}
	if _, err := tx.Exec(ctx, `UPDATE bench_pgq_progress SET consumed = consumed + $1 WHERE id = 1`, len(msgs)); err != nil {
		return 0, fmt.Errorf("count the batch: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT pgq.finish_batch($1)`, *batch); err != nil {
		return 0, fmt.Errorf("finish_batch: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return max(len(msgs), 1), nil // an empty batch is still a batch: look for the next at once
}

// chunkJoin joins items with commas into strings of at most limit bytes each.
func chunkJoin(items []string, limit int) []string {
	var out []string
	var cur strings.Builder
	for _, it := range items {
		if cur.Len() > 0 && cur.Len()+1+len(it) > limit {
			out = append(out, cur.String())
			cur.Reset()
		}
		if cur.Len() > 0 {
			cur.WriteByte(',')
		}
		cur.WriteString(it)
	}
	if cur.Len() > 0 {
		out = append(out, cur.String())
	}
	return out
}

// pgqd is the running ticker.
type pgqd struct {
	cmd    *exec.Cmd
	dir    string
	exited chan struct{}
	err    error
}

// startPgqd runs pgqd in the foreground for the DSN's database only, with its defaults
// (ticker_period 1 s) otherwise; its log goes to this process's stderr.
func startPgqd(dsn string) (*pgqd, error) {
	var base []string
	db := ""
	for _, kv := range strings.Fields(dsn) {
		if v, ok := strings.CutPrefix(kv, "dbname="); ok {
			db = v
			continue
		}
		base = append(base, kv)
	}
	if db == "" {
		return nil, errors.New("pgqd: the DSN names no dbname")
	}
	dir, err := os.MkdirTemp("", "pgqd.")
	if err != nil {
		return nil, err
	}
	ini := filepath.Join(dir, "pgqd.ini")
	conf := fmt.Sprintf("[pgqd]\nbase_connstr = %s\ninitial_database = %s\ndatabase_list = %s\nsyslog = 0\nlogfile = %s\n",
		strings.Join(base, " "), db, db, filepath.Join(dir, "pgqd.log"))
	if err := os.WriteFile(ini, []byte(conf), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	p := &pgqd{dir: dir, exited: make(chan struct{})}
	p.cmd = exec.Command("pgqd", ini)
	p.cmd.Stdout, p.cmd.Stderr = os.Stderr, os.Stderr
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start pgqd: %w", err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// stop ends pgqd (SIGINT: a clean stop), then SIGKILL after 10 s.
func (p *pgqd) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	if log, err := os.ReadFile(filepath.Join(p.dir, "pgqd.log")); err == nil && len(log) > 0 {
		os.Stderr.Write(log)
	}
	os.RemoveAll(p.dir)
}
