// sut.go: the systems under test that run in a process of their own, started by the benchmark
// as `pipeline sut KIND -dsn DSN -stages N [-stamp FILE]`: River (tuned as River's benchmark,
// or with River's defaults), the raw loop and PgQ's consumer (pgq.go). (Graphile Worker runs
// in Node: graphile/run.mjs.) A process of their own, like pepsi-dispatch, so
// that the CPU and peak memory of each system are measured the same way, from /proc, and the
// benchmark's producer and observer are never counted as the system's work.
//
// The process prints "ready" on stdout once it works, runs until SIGTERM or SIGINT, then stops
// and, with -stamp, writes "KEY UNIXNANO" lines: when each message's first stage started.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// River's settings. Tuned: what River's own benchmark (cmd/river/riverbench) configures.
// Defaults: River's defaults; a queue must name its MaxWorkers, and 100 is the value River's
// documentation uses throughout.
const (
	riverTunedMaxWorkers    = 2000
	riverTunedFetchCooldown = 2 * time.Millisecond
	riverTunedFetchPoll     = 20 * time.Millisecond
	riverDefaultMaxWorkers  = 100
)

// Raw loop defaults: goroutines, each with its own connection, and the claim size: 4 × 1000
// rows in flight, as many as pepsi's 4 workers × QUEUE_LIMIT 1000. (More goroutines with
// smaller claims did worse here: every claimer walks the same head of the pending index.)
const (
	rawWorkersDefault = 4
	rawBatchDefault   = 1000
)

// benchArgs is the River job of every workload: message Msg at stage Stage of Last stages. A
// job of a stage before the last inserts the job of the next stage.
type benchArgs struct {
	Msg   int64 `json:"msg"`
	Stage int   `json:"stage"`
	Last  int   `json:"last"`
}

func (benchArgs) Kind() string { return "bench" }

// stamps records when a message's first stage started, in the process that ran it.
type stamps struct {
	on bool
	mu sync.Mutex
	m  map[int64]int64
}

func (s *stamps) record(key int64) {
	if !s.on {
		return
	}
	now := time.Now().UnixNano()
	s.mu.Lock()
	if _, ok := s.m[key]; !ok {
		s.m[key] = now
	}
	s.mu.Unlock()
}

func (s *stamps) write(path string) error {
	if path == "" {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	s.mu.Lock()
	for k, v := range s.m {
		fmt.Fprintf(w, "%d %d\n", k, v)
	}
	s.mu.Unlock()
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

type riverWorker struct {
	river.WorkerDefaults[benchArgs]
	st *stamps
}

func (w *riverWorker) Work(ctx context.Context, job *river.Job[benchArgs]) error {
	if job.Args.Stage == 1 {
		w.st.record(job.Args.Msg)
	}
	if job.Args.Stage < job.Args.Last {
		next := job.Args
		next.Stage++
		_, err := river.ClientFromContext[pgx.Tx](ctx).Insert(ctx, next, nil)
		return err
	}
	return nil
}

// sutMain is `pipeline sut KIND ...`; it returns the exit status.
func sutMain(args []string) int {
	if len(args) < 1 {
		fmt.Fprintln(os.Stderr, "usage: pipeline sut river|river-default|raw|pgq -dsn DSN -stages N [-stamp FILE]")
		return 2
	}
	kind := args[0]
	fs := flag.NewFlagSet("sut", flag.ContinueOnError)
	dsn := fs.String("dsn", "", "database")
	stages := fs.Int("stages", 1, "stages of the pipeline")
	stampPath := fs.String("stamp", "", "write first-stage start times here at exit")
	rawWorkers := fs.Int("raw-workers", rawWorkersDefault, "raw loop: goroutines")
	rawBatch := fs.Int("raw-batch", rawBatchDefault, "raw loop: rows per claim")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	st := &stamps{on: *stampPath != "", m: map[int64]int64{}}
	var err error
	switch kind {
	case "river", "river-default":
		err = runRiver(ctx, *dsn, kind == "river", st)
	case "raw":
		err = runRaw(ctx, *dsn, *stages, *rawWorkers, *rawBatch, st)
	case "pgq":
		err = runPgq(ctx, *dsn, st)
	default:
		err = fmt.Errorf("unknown system %q", kind)
	}
	if werr := st.write(*stampPath); err == nil {
		err = werr
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "sut %s: %v\n", kind, err)
		return 1
	}
	return 0
}

func runRiver(ctx context.Context, dsn string, tuned bool, st *stamps) error {
	// A default pgx pool, as River's CLI benchmark opens it (max(4, NumCPU) connections).
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	workers := river.NewWorkers()
	river.AddWorker(workers, &riverWorker{st: st})
	cfg := &river.Config{
		Logger:  slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: riverDefaultMaxWorkers}},
		Workers: workers,
	}
	if tuned {
		cfg.FetchCooldown = riverTunedFetchCooldown
		cfg.FetchPollInterval = riverTunedFetchPoll
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: riverTunedMaxWorkers}}
	}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		return err
	}
	if err := client.Start(context.Background()); err != nil {
		return err
	}
	fmt.Println("ready")
	<-ctx.Done()
	stopCtx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return client.Stop(stopCtx)
}

// The raw loop: the same row writes as pepsi, issued directly by a few goroutines with no
// coordinator. Claim: the dispatcher's statement shape (claim.go), per stage, plus SKIP LOCKED
// since several goroutines claim: the pick walks the partial index workqueue_pending in
// (stage, priority, id) order (`stage = ANY (ARRAY[...])` with that ORDER BY leaves the planner no
// other ordered path, whatever the statistics say), and the UPDATE fetches exactly the picked
// ids by primary key (the coalesce keeps it off the partial index). Outcome: the SDK's set-based UPDATE of a
// batch's outcomes (stage/stage.go, outcomeStatement: unnest of the ids and their new stage,
// status and state, under the same guard), one statement per claim: a raw batched UPDATE loop,
// the floor of what pepsi's SQL costs on the machine. Like pepsi's, the claim commits
// asynchronously (its own transaction only; claim.go says why that is safe).
const (
	rawClaimSQL = `UPDATE workqueue q
   SET status = 'running', claim = (SELECT nextval('workqueue_claim_seq')), claimed_at = now()
 WHERE q.workqueue_id = ANY (ARRAY(
        SELECT workqueue_id FROM workqueue
         WHERE status = 'pending' AND NOT key_parked AND stage = ANY (ARRAY[$1::text])
         ORDER BY stage, priority, workqueue_id LIMIT $2 FOR UPDATE SKIP LOCKED))
   AND coalesce(q.status, '') = 'pending'
   AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
RETURNING q.workqueue_id`
	rawOutcomesSQL = `UPDATE workqueue AS w SET stage = coalesce(v.stage, w.stage), status = v.status,
       attempts = CASE WHEN v.stage IS NULL THEN w.attempts ELSE 0 END, state = coalesce(v.state, w.state)
  FROM unnest($1::bigint[], $2::text[], $3::text[], $4::jsonb[]) AS v (id, stage, status, state),
       (SELECT 'running'::text AS status, $5::text AS stage OFFSET 0) AS guard
 WHERE w.workqueue_id = ANY ($1::bigint[]) AND w.workqueue_id = v.id
   AND w.status = guard.status AND w.stage = guard.stage`
)

func runRaw(ctx context.Context, dsn string, nstages, rawWorkers, rawBatch int, st *stamps) error {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(rawWorkers + 1)
	// Named like pepsi's sessions, so that the schema's requeue trigger skips the advances,
	// exactly as it does for a pepsi stage.
	cfg.ConnConfig.RuntimeParams["application_name"] = "pepsi-raw-loop"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	defer pool.Close()

	// One listener wakes every goroutine on an enqueue; a goroutine that finds nothing waits
	// for it (or half a second, as a safety net).
	var (
		wakeMu sync.Mutex
		wakeCh = make(chan struct{})
	)
	wake := func() {
		wakeMu.Lock()
		close(wakeCh)
		wakeCh = make(chan struct{})
		wakeMu.Unlock()
	}
	waitCh := func() <-chan struct{} {
		wakeMu.Lock()
		defer wakeMu.Unlock()
		return wakeCh
	}
	lconn, err := pool.Acquire(context.Background())
	if err != nil {
		return err
	}
	if _, err := lconn.Exec(context.Background(), "LISTEN workqueue"); err != nil {
		lconn.Release()
		return err
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer lconn.Release()
		for ctx.Err() == nil {
			if _, err := lconn.Conn().WaitForNotification(ctx); err != nil && ctx.Err() == nil {
				fmt.Fprintf(os.Stderr, "raw: listen: %v\n", err)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			wake()
		}
	}()

	names := make([]string, nstages)
	for i := range names {
		names[i] = "s" + strconv.Itoa(i+1)
	}
	errs := make(chan error, rawWorkers)
	for w := 0; w < rawWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- rawWorker(ctx, pool, names, rawBatch, st, waitCh)
		}()
	}
	fmt.Println("ready")
	<-ctx.Done()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return nil
}

func rawWorker(ctx context.Context, pool *pgxpool.Pool, names []string, rawBatch int, st *stamps, waitCh func() <-chan struct{}) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	ids := make([]int64, 0, rawBatch)
	for ctx.Err() == nil {
		ch := waitCh() // before the claim, so that an enqueue during it is not missed
		worked := false
		// Later stages first: finish messages in flight before starting new ones.
		for si := len(names) - 1; si >= 0; si-- {
			ids = ids[:0]
			rows, err := conn.Query(ctx, rawClaimSQL, names[si], rawBatch)
			if err != nil {
				return fmt.Errorf("claim: %w", err)
			}
			for rows.Next() {
				var id int64
				if err := rows.Scan(&id); err != nil {
					rows.Close()
					return fmt.Errorf("claim: %w", err)
				}
				ids = append(ids, id)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return fmt.Errorf("claim: %w", err)
			}
			if len(ids) == 0 {
				continue
			}
			worked = true
			if si == 0 {
				for _, id := range ids {
					st.record(id)
				}
			}
			if err := rawOutcomes(ctx, conn.Conn(), ids, names, si); err != nil {
				return err
			}
		}
		if !worked {
			select {
			case <-ctx.Done():
			case <-ch:
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	return ctx.Err()
}

// rawOutcomes writes a claim's outcomes in one statement (its own transaction), sent with
// its values inlined (the simple protocol), as the SDK inlines them: a custom plan every time.
// The states are all NULL: the no-op stage leaves the empty state empty, and the SDK then
// sends none (stage/outcome.go, keptChange.same).
func rawOutcomes(ctx context.Context, conn *pgx.Conn, ids []int64, names []string, si int) error {
	stages := make([]*string, len(ids))
	statuses := make([]string, len(ids))
	states := make([]*string, len(ids))
	for i := range ids {
		statuses[i] = "done"
		if si+1 < len(names) {
			stages[i], statuses[i] = &names[si+1], "pending"
		}
	}
	tag, err := conn.Exec(ctx, rawOutcomesSQL, pgx.QueryExecModeSimpleProtocol, ids, stages, statuses, states, names[si])
	if err != nil {
		return fmt.Errorf("outcomes: %w", err)
	}
	if int(tag.RowsAffected()) != len(ids) {
		return fmt.Errorf("outcomes: %d of %d rows written", tag.RowsAffected(), len(ids))
	}
	return nil
}
