// Package stage is the SDK for pepsi-dispatch stage programs: a stage becomes a handler
// function, and the package speaks the worker protocol, holds the database connection and
// writes each message's outcome.
//
//	func main() {
//		stage.Run(func(ctx context.Context, m *stage.Message) error {
//			m.State["seen"] = true
//			return m.Advance("next-stage")
//		})
//	}
//
// A program that implements several stages gives RunStages a handler per stage; it serves the
// stage it is started for and can run the others in the same pass (stage fusion, below).
//
// The package's module path, pepsi-dispatch, is no address the go command can fetch: a stage
// in a module of its own requires it from a checkout of this repository (a path relative to
// the module, or absolute) with a replace directive, then runs go mod tidy and go build
// (TestOwnModule does so):
//
//	require pepsi-dispatch v0.0.0
//
//	replace pepsi-dispatch => ../pepsi-dispatch
//
// The rest of this comment is the worker protocol itself, complete enough to write a stage in
// any language without this package.
//
// # Start
//
// pepsi-dispatch runs each stage's PROGRAM as long-lived worker processes, started as
//
//	PROGRAM -c CONFIG_FILE worker     (or PROGRAM worker when there is no CONFIG_FILE)
//
// with these environment variables:
//
//	PEPSI_STAGE   the stage this process serves
//	PEPSI_NEXT    the stages it may advance a message to, separated by spaces (empty: final stage)
//	PEPSI_FUSE    the stages it may run in the same pass (see Stage fusion); empty: none
//	PEPSI_DSN     the libpq connection string of [database] DSN
//
// The DSN carries an application_name starting with "pepsi-": keep it. The schema's requeue
// trigger skips sessions with such a name, so an advance does not wake the dispatcher through
// NOTIFY (the status line does that already). A worker connects once and keeps the connection
// for its whole life; if it breaks, the worker exits non-zero instead of reconnecting. A
// worker killed at MAX_RUNTIME in the middle of a statement leaves the statement running, with
// the locks of its transaction, until it ends: a handler whose statements can run long should
// set client_connection_check_interval or statement_timeout (pepsi-worker(7)).
//
// # Standard input and output
//
// Standard input carries one decimal message id (a workqueue_id) per line. For each id, in
// order, the worker writes one line on standard output:
//
//	0                 success: the stage has committed the message's outcome
//	0 WORDS           success, with report words
//	N REASON          failure (N a non-zero decimal, this SDK uses 1): REASON, one line, is
//	                  recorded by the dispatcher in state.dispatch_error
//
// A success line is "0" followed by zero or more words, each after a single space; a word is a
// run of printable characters other than space. A reader ignores the words it does not know
// (later versions may add some), and a writer puts each word at most once. The words defined:
//
//	done                        the message reached status 'done' in this pass
//	                            (dispatch_stats.done counts it)
//	fused=STAGE:MS[,STAGE:MS…]  the stages run in this pass after the worker's own (stage
//	                            fusion), in the order they ran, each with the time it took
//	                            in whole milliseconds (stage_stats.fused and busy_ms of STAGE)
//
// For example "0", "0 done", "0 fused=enrich:3" (enrich advanced it further) and
// "0 done fused=enrich:3,deliver:1" (deliver finished it).
//
// The dispatcher writes up to QUEUE_LIMIT ids at once and may write more before the first
// reply: a worker must keep reading while it works, or at least never stop answering in
// order. The dispatcher measures MAX_RUNTIME from the moment an id reaches the head of the
// worker's queue, so a worker that answers in batches should keep its batches short.
//
// On EOF on standard input the worker finishes the ids it has read, answers them and exits 0.
// Standard error goes to the dispatcher's log, tagged with the stage and the pid. Run and
// RunStages keep the ids and the replies on descriptors of their own, point standard output
// (descriptor 1, and os.Stdout) at standard error and standard input at /dev/null: what a
// handler prints, or a program it starts without capturing its output, is logged, not taken
// for a reply, and a program that reads its standard input (ssh, ffmpeg) takes no id. Exiting
// without answering (a crash, SIGTERM, SIGKILL) is always safe: the dispatcher fails the
// message at the head of the queue and puts the others back to pending, in both cases only
// if the row is still the claim it handed out.
//
// # Processing a message
//
// When the dispatcher hands over an id, it has already set the row's status to 'running' at
// the worker's stage. The worker reads the row (payload is set at enqueue and never changes;
// state is the stage's jsonb scratchpad; attempts counts failed attempts) and, on success,
// commits exactly one outcome, as ONE UPDATE guarded by the claim, before it writes "0":
//
//	-- advance: to one of PEPSI_NEXT; the dispatcher's next claim takes it for that stage
//	UPDATE workqueue SET stage = 'NEXT', status = 'pending', state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//	-- done
//	UPDATE workqueue SET status = 'done', state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//	-- defer: the dispatcher puts it back to pending at this stage when retry_at is due
//	UPDATE workqueue SET status = 'paused', retry_at = $until, state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//
// (A fan-out split sets status = 'waiting' instead, under the same guard; see
// doc/design/fanin.md, "Split".) If the UPDATE changes no row, the claim is gone (the
// dispatcher took the message back): roll back and answer non-zero. The stage's own writes
// belong in the same transaction, so they commit if and only if the outcome does. A stage never
// writes a failure itself: it answers non-zero and the dispatcher records it (attempts + 1,
// state.dispatch_error, paused with back-off or failed) under its own claim guard. A stage must
// not touch the statistics tables.
//
// # Stage fusion
//
// A stage whose section says FUSE = yes may be run by the worker of a stage that advances to
// it, in the same pass. The dispatcher lists in PEPSI_FUSE every FUSE = yes stage reachable
// from the worker's stage through NEXT links to FUSE = yes stages, each with its own NEXT list:
// entries separated by spaces, each STAGE=NEXT1,NEXT2, with an empty list for a final stage.
// With parse (NEXT = enrich), enrich (FUSE = yes, NEXT = deliver) and deliver (FUSE = yes), the
// workers of parse get
//
//	PEPSI_FUSE=enrich=deliver deliver=
//
// A worker that implements Y of its PEPSI_FUSE may, where it would advance a message to Y,
// run Y's work instead, in the same transaction, and commit Y's outcome in place of the
// advance: one UPDATE under the guard of the claim it was handed, which names the worker's
// own stage (THIS), because the row is running there until the commit:
//
//	-- Y advances to Z, one of Y's NEXT stages in PEPSI_FUSE
//	UPDATE workqueue SET stage = 'Z', status = 'pending', attempts = 0, state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//	-- Y finishes, or defers (status = 'paused', retry_at = $until): the row names Y
//	UPDATE workqueue SET stage = 'Y', status = 'done', attempts = 0, state = $state
//	 WHERE workqueue_id = $id AND status = 'running' AND stage = 'THIS';
//
// Z may be fused in turn, so may its successors, each stage at most once per pass. The status
// line reports the fused stages (fused=Y:MS,…, above), which the dispatcher credits to them:
// stage_stats are still written by the dispatcher alone. If Y fails, its work is undone alone
// (a savepoint) and the advance to Y is committed instead: the message then waits at Y for
// Y's own workers, which fail it there if they must; a fused stage's failure never reaches the
// status line. To the dispatcher the pass is one message of the worker's stage: MAX_RUNTIME
// covers all of it, and a crash or a timeout during a fused stage fails the message at the
// worker's stage. Fusion is optional: a worker may ignore PEPSI_FUSE and advance as usual.
//
// # What this package does
//
// Run parses the command line and environment (LoadConfig), and Serve runs the loop; RunStages
// and ServeStages do the same for a program with a handler per stage, and fuse the stages of
// PEPSI_FUSE they have a handler for. Run and RunStages set runtime.GOMAXPROCS(1) unless the
// environment sets GOMAXPROCS: a worker runs one batch at a time on one connection, and idle
// runtime threads woken at every pipe and socket event cost a machine shared with PostgreSQL
// and the other workers 15-25 % of its throughput (BENCHMARKS.md). A handler that wants
// parallelism of its own sets GOMAXPROCS in the worker's environment. Every id already waiting
// on standard input (at least one, at most 256) forms one batch, run in one transaction:
//
//	SELECT workqueue_id, attempts, payload, state FROM workqueue
//	 WHERE workqueue_id = ANY($ids) AND status = 'running' AND stage = $stage
//	  (workqueue_id = $id for a batch of one)
//	for each id, in order: the handler, its own statements inside a SAVEPOINT of its own
//	  (the first SAVEPOINT of the batch is sent as BEGIN ISOLATION LEVEL READ COMMITTED;
//	  SAVEPOINT …),
//	  then the handlers of the fused stages its advance leads to, each in a lazy SAVEPOINT
//	  of its own (nested in the message's savepoints opened before it)
//	COMMIT, if BEGIN was sent
//	one UPDATE … FROM unnest($ids, $stages, …) RETURNING for the outcomes not written yet (below)
//	then all the batch's status lines, in one write
//
// The transaction begins with the first statement that needs to be undoable alone: a handler's
// statement on Message.Tx. When no handler of the batch sends one, there is no transaction: the
// load and the outcome statement run as statements of their own (each atomic, and under READ
// COMMITTED each statement reads its own snapshot in a transaction too; the load locks nothing).
// The outcomes not written yet are those of handlers that sent no statement: they have nothing
// to commit with, and run after the COMMIT, outside the transaction.
//
// The transaction is READ COMMITTED whatever the database's default_transaction_isolation, as
// the dispatcher's sessions are: at SERIALIZABLE, a batch of many messages takes a predicate
// lock on the whole queue table and concurrent workers' batches fail each other. A handler's
// statements share it. The load and the outcome statement run at the session's level; a batch
// or an outcome statement that ends in a serialization failure or a deadlock before anything
// of it committed runs again, up to 8 times in all (transient.go).
//
// The worker's session is idle between batches, for up to the dispatcher's
// WORKER_IDLE_TIMEOUT: when it connects, it turns off a role's idle_session_timeout for itself
// (conn.go), which ended it at every quiet spell and the worker with it, its batch's first
// message charged an attempt. idle_in_transaction_session_timeout is left as the operator set
// it: a handler that pauses that long between two of its own statements loses the session, and
// the worker exits as on any lost connection.
//
// A batch stops taking messages (the ids left over start the next batch) when the next
// message could take the transaction past 64 savepoints, the subtransactions PostgreSQL caches
// per backend (one per stage of its pass that writes: N+1 for a program that can fuse N), or
// when it has run for 100 ms: its replies wait for its end. After a batch that began a
// transaction a worker reads no more ids than 64/(N+1), so that leftovers are rare.
//
// An id whose row is not running at the stage is answered "1 ... (claim lost)" without running
// the handler. A handler that returns an error (or panics, or chooses no outcome, or two) fails
// its message: the SDK rolls back to the message's savepoint, so its writes and its outcome are
// undone and the other messages of the batch are not affected. If the commit fails, every
// message of the batch is answered non-zero with the reason; if the connection is lost, the
// process exits non-zero without answering, and the dispatcher recovers.
//
// One commit, that is one WAL flush, serves the whole batch, and the requests per message are
// few. The savepoint is taken lazily, in the same request as the handler's first statement on
// Message.Tx (or as its outcome), so a handler that never uses Message.Tx needs none. The
// outcome of such a handler is kept, with the state as it was when chosen, and written after
// the handler returned, together with the batch's other kept outcomes, in one statement that
// keeps each row's guard (RETURNING tells which rows it found; the others fail as claim lost).
// A batch of N messages whose handlers do not use Message.Tx thus costs 2 round trips (the load
// and the outcome statement, whose arrays are literals so that PostgreSQL plans it for the
// batch's size) instead of N + 3, fused stages included: their outcome replaces the
// advance in that statement. Should the outcome statement fail, the outcomes are written one
// by one, so that one bad message fails alone. A handler that does use Message.Tx adds one
// round trip for BEGIN (the batch's first) and its SAVEPOINT, its own statements, and its
// outcome's UPDATE, written at once inside the savepoint; the transaction then ends with
// COMMIT, before the outcome statement. A fused stage's savepoint request also moves the running row to that stage
// (UPDATE … SET stage = Y, attempts = 0 under the claim's guard), so that its handler, and the
// guards of its statements, see the row running at Y; the pass's outcome is then guarded by Y.
package stage
