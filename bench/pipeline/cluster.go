// cluster.go: the private PostgreSQL cluster (scripts/pg-private), its databases and the
// statistics the report reads from it (WAL position, pg_stat_statements, pg_stat_database).
package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

type cluster struct {
	dir     string // the cluster's directory (data/, the socket, logs)
	script  string // scripts/pg-private
	dsnBase string // the DSN pg-private printed (dbname=postgres)
	admin   *pgxpool.Pool
	version string
	started bool
}

// runScript runs pg-private in a process group of its own, so that a Ctrl-C at the terminal
// reaches only the benchmark, which then stops the cluster in order.
func (c *cluster) runScript(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, c.script, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("pg-private %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

// startCluster initialises and starts the cluster with PostgreSQL's defaults (as pg-private
// sets them: synchronous_commit = on, fsync = on) plus pg_stat_statements, which needs a
// restart to load.
func startCluster(ctx context.Context, root, dir string) (*cluster, error) {
	c := &cluster{dir: dir, script: filepath.Join(root, "scripts", "pg-private")}
	dsn, err := c.runScript(ctx, "start", dir)
	if err != nil {
		return nil, err
	}
	c.started = true
	c.dsnBase = dsn
	conf := filepath.Join(dir, "data", "postgresql.conf")
	f, err := os.OpenFile(conf, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return c, fmt.Errorf("open %s: %w", conf, err)
	}
	_, err = f.WriteString("\n# pepsi-dispatch bench: statement statistics for the report\n" +
		"shared_preload_libraries = 'pg_stat_statements'\n" +
		"pg_stat_statements.max = 5000\n" +
		"pg_stat_statements.track = top\n" +
		"pg_stat_statements.track_utility = on\n" +
		"# auto_explain in every session: the plan (without ANALYZE, which would slow every\n" +
		"# statement) of any statement slower than 200 ms, for the report; the diagnostic run\n" +
		"# turns on ANALYZE and a lower threshold for its database. Logged at warning level,\n" +
		"# the level pg-private keeps, with the session's application and database.\n" +
		"session_preload_libraries = 'auto_explain'\n" +
		"auto_explain.log_min_duration = '200ms'\n" +
		"auto_explain.log_level = warning\n" +
		"log_line_prefix = '%m [%p] %a@%d '\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return c, fmt.Errorf("write %s: %w", conf, err)
	}
	if _, err := c.runScript(ctx, "restart", dir); err != nil {
		return c, err
	}
	c.admin, err = newPool(ctx, c.dsn("postgres"), 4)
	if err != nil {
		return c, err
	}
	if _, err := c.admin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		return c, fmt.Errorf("create extension pg_stat_statements: %w", err)
	}
	if err := c.admin.QueryRow(ctx, "SHOW server_version").Scan(&c.version); err != nil {
		return c, fmt.Errorf("server version: %w", err)
	}
	return c, nil
}

// stop stops the cluster (fast shutdown); safe to call more than once.
func (c *cluster) stop() {
	if c.admin != nil {
		c.admin.Close()
		c.admin = nil
	}
	if !c.started {
		return
	}
	c.started = false
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if _, err := c.runScript(ctx, "stop", c.dir); err != nil {
		logf("stopping the cluster: %v", err)
	}
}

// dsn is the cluster's DSN with another database.
func (c *cluster) dsn(db string) string {
	f := strings.Fields(c.dsnBase)
	for i, kv := range f {
		if strings.HasPrefix(kv, "dbname=") {
			f[i] = "dbname=" + db
		}
	}
	return strings.Join(f, " ")
}

// logPath is the server log, where auto_explain writes.
func (c *cluster) logPath() string { return filepath.Join(c.dir, "server.log") }

// logOffset is the server log's current size: where the next run's entries begin.
func (c *cluster) logOffset() int64 {
	fi, err := os.Stat(c.logPath())
	if err != nil {
		return 0
	}
	return fi.Size()
}

// postmasterPID reads the first line of data/postmaster.pid.
func (c *cluster) postmasterPID() int {
	b, err := os.ReadFile(filepath.Join(c.dir, "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(line))
	return pid
}

// createDB creates a database and returns a pool on it.
func (c *cluster) createDB(ctx context.Context, name string, conns int32) (*pgxpool.Pool, error) {
	if _, err := c.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("drop database %s: %w", name, err)
	}
	if _, err := c.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database %s: %w", name, err)
	}
	return newPool(ctx, c.dsn(name), conns)
}

// newPool opens a pgx pool; the benchmark's own sessions are named "bench". params are
// further settings of its sessions, as name, value pairs.
func newPool(ctx context.Context, dsn string, conns int32, params ...string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("parse DSN: %w", err)
	}
	cfg.MaxConns = conns
	cfg.ConnConfig.RuntimeParams["application_name"] = "bench"
	for i := 0; i+1 < len(params); i += 2 {
		cfg.ConnConfig.RuntimeParams[params[i]] = params[i+1]
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	if err := p.Ping(ctx); err != nil {
		p.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	return p, nil
}

// execScript runs a multi-statement SQL script (simple query protocol).
func execScript(ctx context.Context, p *pgxpool.Pool, script string) error {
	conn, err := p.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	_, err = conn.Conn().PgConn().Exec(ctx, script).ReadAll()
	return err
}

// walLSN is the current WAL insert position, in bytes.
func (c *cluster) walLSN(ctx context.Context) int64 {
	var n int64
	if err := c.admin.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint").Scan(&n); err != nil {
		logf("read WAL position: %v", err)
	}
	return n
}

// checkpoint flushes dirty buffers before a measured run, so that every run starts with the
// same full-page-write state and no checkpoint debt from the previous one.
func (c *cluster) checkpoint(ctx context.Context) {
	if _, err := c.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		logf("checkpoint: %v", err)
	}
}

// dbOID returns a database's oid, for pg_stat_statements' dbid.
func (c *cluster) dbOID(ctx context.Context, name string) uint32 {
	var oid uint32
	if err := c.admin.QueryRow(ctx, "SELECT oid FROM pg_database WHERE datname = $1", name).Scan(&oid); err != nil {
		logf("oid of %s: %v", name, err)
	}
	return oid
}

// resetStatements clears pg_stat_statements for one database.
func (c *cluster) resetStatements(ctx context.Context, db string) {
	if _, err := c.admin.Exec(ctx, "SELECT pg_stat_statements_reset(0, $1::oid, 0)", c.dbOID(ctx, db)); err != nil {
		logf("reset pg_stat_statements: %v", err)
	}
}

// stmtStat is one row of pg_stat_statements.
type stmtStat struct {
	Query   string
	Calls   int64
	Rows    int64
	TotalMS float64
	WALB    int64
}

// topStatements reads the statements of one database, heaviest first, and the total calls.
func (c *cluster) topStatements(ctx context.Context, db string, limit int) ([]stmtStat, int64) {
	rows, err := c.admin.Query(ctx, `
		SELECT query, calls, rows, total_exec_time, wal_bytes::bigint
		  FROM pg_stat_statements WHERE dbid = $1
		 ORDER BY total_exec_time DESC`, c.dbOID(ctx, db))
	if err != nil {
		logf("read pg_stat_statements: %v", err)
		return nil, 0
	}
	defer rows.Close()
	var out []stmtStat
	var calls int64
	for rows.Next() {
		var s stmtStat
		if err := rows.Scan(&s.Query, &s.Calls, &s.Rows, &s.TotalMS, &s.WALB); err != nil {
			logf("read pg_stat_statements: %v", err)
			return out, calls
		}
		calls += s.Calls
		if len(out) < limit {
			out = append(out, s)
		}
	}
	return out, calls
}

// xactCommits is pg_stat_database.xact_commit + xact_rollback of a database.
func (c *cluster) xactCommits(ctx context.Context, db string) int64 {
	var n int64
	if err := c.admin.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1`, db).Scan(&n); err != nil {
		logf("read pg_stat_database: %v", err)
	}
	return n
}
