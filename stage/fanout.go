// fanout.go: fan-out and fan-in for stage programs (doc/design/fanin.md): splitting a message
// into child messages, reading the children's outcome in the continuation stage, and working
// through a range child's slice page by page.
//
// Every write here is a message's outcome, made through Message.outcome and the SQL functions
// of fanin.sql, in the message's transaction and under its claim guard (status = 'running' AND
// stage = this stage). This file never writes the fanout, fanin_event or fanin_wake_log
// tables, nor a parent row after its split: those belong to the dispatcher (invariant I1 of
// doc/design/fanin.md, "Invariants").

package stage

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/lib/pq"
)

const (
	// MaxChildrenDefault and MinSpanDefault are RangeOpts' defaults, the defaults of the
	// stage keys MAX_CHILDREN and MIN_SPAN (doc/design/fanin.md, "Configuration").
	MaxChildrenDefault = 10000
	MinSpanDefault     = 1000

	// PageSizeDefault is PageOpts.PageSize's default: rows per page of a range child.
	PageSizeDefault = 500

	// cursorKey is the key of a range child's state that holds its keyset cursor: the lower
	// bound of what it has left to do. The SDK owns it (fanin.sql's fanout_child_cursor reads
	// the same key).
	cursorKey = "cursor"

	// sqlClaimGone is the SQLSTATE fanin.sql raises when the split stage's claim is gone.
	sqlClaimGone = "PF001"
)

// Sentinel errors of the fan-in helpers, for errors.Is.
var (
	// ErrNotParent means the message has no fan-out group: it never split, or split into
	// nothing (an empty split advances the parent directly).
	ErrNotParent = errors.New("message has no fan-out group")

	// ErrGroupOpen means the message's group has not fired: some children are not terminal
	// yet. A continuation woken by the dispatcher never sees it.
	ErrGroupOpen = errors.New("fan-out group has not fired yet")

	// ErrNotRangeChild means Paginate was called for a message that is not a range child.
	ErrNotRangeChild = errors.New("message is not a range child (no range_lo)")
)

// Split is the message's outcome when it fans out: one child message at childStage per
// element of payloads (its payload; nil is JSON null), all 'pending', and the message itself
// 'waiting' at continuation, with its state, until every child is done or failed. The
// dispatcher then sets it 'pending' at continuation, once, where FaninResult reads how the
// children ended. Children, group and parent are written in m.Tx in one statement
// (fanout_split), so they commit together with the rest of the message's work, or not at all.
//
// continuation must be one of the stage's NEXT stages (ErrNotNext); childStage is any stage of
// the pipeline. With no payloads there is no group: the message advances to continuation at
// once, like Advance. Split is an outcome: a second outcome fails (ErrOutcomeChosen), and a
// claim found gone returns an error wrapping ErrClaimLost. 100,000 children take about a
// second to insert; prefer SplitRange and paginating children over one child per row.
func (m *Message) Split(ctx context.Context, continuation, childStage string, payloads []json.RawMessage) error {
	what := fmt.Sprintf("split into %d children at %s", len(payloads), childStage)
	if err := m.checkSplit(what, continuation, childStage); err != nil {
		return err
	}
	if payloads == nil {
		payloads = []json.RawMessage{}
	}
	arr, err := json.Marshal(payloads)
	if err != nil {
		return fmt.Errorf("%s, message %d: encode payloads: %w", what, m.ID, err)
	}
	return m.outcome(ctx, func(tx *sql.Tx) error {
		state, err := m.stateJSON()
		if err != nil {
			return fmt.Errorf("%s, message %d: encode state: %w", what, m.ID, err)
		}
		var fid sql.NullInt64
		err = tx.QueryRowContext(ctx, `SELECT fanout_split($1, $2, $3, $4, $5::jsonb, $6::jsonb)`,
			m.ID, m.Stage, continuation, childStage, string(arr), string(state)).Scan(&fid)
		return splitError(what, m.ID, err)
	})
}

// RangeOpts are the choices of SplitRange. The zero value is equal-width slices with the
// stage's MAX_CHILDREN and MIN_SPAN (Config), else MaxChildrenDefault and MinSpanDefault.
type RangeOpts struct {
	// MaxChildren caps the number of children. 0 means the split stage's MAX_CHILDREN
	// (Config.MaxChildren, from PEPSI_MAX_CHILDREN), else MaxChildrenDefault.
	MaxChildren int

	// MinSpan is the narrowest slice: every child gets at least MinSpan ids of the range (or,
	// with IDQuery, at least MinSpan rows), unless the whole range has fewer and there is one
	// child. 0 means the split stage's MIN_SPAN (Config.MinSpan), else MinSpanDefault.
	MinSpan int64

	// IDQuery, when set, cuts the range into slices holding equal numbers of rows rather than
	// equal widths, for skewed ids: a query whose first column is the ids of the rows to act
	// on (rows outside [lo, hi] are ignored), for example
	// "SELECT id FROM target WHERE region = " + pq.QuoteLiteral(r). It runs in m.Tx, once
	// (fanout_count_bounds), and takes no $n parameters: inline values with pq.QuoteLiteral.
	// The slices still cover [lo, hi] exactly; no rows at all is an empty split.
	IDQuery string

	// Payload is every child's payload (nil: NULL), for what the slices have in common: the
	// table, the condition, the action.
	Payload json.RawMessage
}

// SplitRange is Split for the group action (doc/design/fanin.md, "Split"): the id range
// [lo, hi] (both inclusive, typically SELECT min(id), max(id) FROM target WHERE cond) is cut into
// half-open slices [range_lo, range_hi), one child at childStage each, contiguous and covering
// [lo, hi] exactly, with no empty slice; a slice ending at the int8 maximum has range_hi NULL.
// Equal width by default, equal row counts with opts.IDQuery. lo > hi (no rows) is an empty
// split: the message advances to continuation at once. Each child works through its slice with
// Paginate. Otherwise as Split: an outcome, in m.Tx, continuation one of NEXT.
//
// Rows that come to match after the split, beyond hi, are not the group's: the group acts on
// the rows that existed when it split.
func (m *Message) SplitRange(ctx context.Context, continuation, childStage string, lo, hi int64, opts RangeOpts) error {
	what := fmt.Sprintf("split [%d, %d] at %s", lo, hi, childStage)
	if err := m.checkSplit(what, continuation, childStage); err != nil {
		return err
	}
	// 0 means the stage's configuration (MAX_CHILDREN, MIN_SPAN), then the defaults.
	maxChildren, minSpan := opts.MaxChildren, opts.MinSpan
	if maxChildren == 0 {
		maxChildren = m.srv.cfg.MaxChildren
	}
	if maxChildren == 0 {
		maxChildren = MaxChildrenDefault
	}
	if minSpan == 0 {
		minSpan = m.srv.cfg.MinSpan
	}
	if minSpan == 0 {
		minSpan = MinSpanDefault
	}
	if maxChildren < 0 || minSpan < 0 {
		return fmt.Errorf("%s, message %d: MaxChildren %d and MinSpan %d must not be negative", what, m.ID, maxChildren, minSpan)
	}
	var payload any // NULL unless set
	if opts.Payload != nil {
		if !json.Valid(opts.Payload) {
			return fmt.Errorf("%s, message %d: the children's payload is not valid JSON", what, m.ID)
		}
		payload = string(opts.Payload)
	}
	return m.outcome(ctx, func(tx *sql.Tx) error {
		state, err := m.stateJSON()
		if err != nil {
			return fmt.Errorf("%s, message %d: encode state: %w", what, m.ID, err)
		}
		var fid sql.NullInt64
		if opts.IDQuery == "" {
			err = tx.QueryRowContext(ctx, `SELECT fanout_split_range($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10::jsonb)`,
				m.ID, m.Stage, continuation, childStage, lo, hi, maxChildren, minSpan, payload, string(state)).Scan(&fid)
		} else {
			err = tx.QueryRowContext(ctx, `SELECT fanout_split_bounds($1, $2, $3, $4,
			        fanout_count_bounds($5, $6, $7, $8, $9), $10::jsonb, $11::jsonb)`,
				m.ID, m.Stage, continuation, childStage, opts.IDQuery, lo, hi, maxChildren, minSpan,
				payload, string(state)).Scan(&fid)
		}
		return splitError(what, m.ID, err)
	})
}

// checkSplit checks a split's stages before it becomes the message's outcome.
func (m *Message) checkSplit(what, continuation, childStage string) error {
	if !slices.Contains(m.srv.cfg.Next, continuation) {
		return fmt.Errorf("%s, message %d: continuation %q: %w (NEXT of %s: %q)", what, m.ID, continuation,
			ErrNotNext, m.Stage, strings.Join(m.srv.cfg.Next, " "))
	}
	if !stageName.MatchString(childStage) {
		return fmt.Errorf("%s, message %d: child stage %q: want [a-z0-9_-]+", what, m.ID, childStage)
	}
	return nil
}

// splitError maps an error of a split statement: the claim guard's SQLSTATE becomes
// ErrClaimLost.
func splitError(what string, id int64, err error) error {
	if err == nil {
		return nil
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && pqErr.Code == sqlClaimGone {
		return fmt.Errorf("%s, message %d: %s: %w", what, id, pqErr.Message, ErrClaimLost)
	}
	return fmt.Errorf("%s, message %d: %w", what, id, err)
}

// FailedChild is a child that ended 'failed', as the continuation stage sees it.
type FailedChild struct {
	// ID is the child's workqueue_id; it stays in the queue (failed rows are not pruned), so
	// a continuation may requeue it or re-split its slice as the next generation.
	ID int64

	// Seq is the child's index in its split (fanout_seq): the index of its payload, or of its
	// slice.
	Seq int

	// RangeLo and RangeHi are the child's slice [RangeLo, RangeHi) of a SplitRange. RangeLo is
	// nil for a child of Split; RangeHi is nil for those and for a slice running to the int8
	// maximum.
	RangeLo, RangeHi *int64

	// Error is the reason the dispatcher recorded for the last failed attempt
	// (state.dispatch_error); "" when someone else failed it without one.
	Error string

	// Payload is the child's payload; nil for NULL.
	Payload json.RawMessage
}

// FaninResult tells the continuation stage how the children of the message's last split
// ended: how many are done and how many failed, as the dispatcher counted them when it woke
// the message, and the failed ones in split order. The policy is the stage's: fail, tolerate
// some failures, or re-split the failed slices. It reads in m.Tx and chooses no outcome.
//
// It returns ErrNotParent if the message never split into a group, and ErrGroupOpen if its
// group has not fired (the message was moved to its continuation by hand).
func (m *Message) FaninResult(ctx context.Context) (done, failed int, failedChildren []FailedChild, err error) {
	var state string
	err = m.Tx.QueryRowContext(ctx, `SELECT state, done_n, failed_n FROM fanin_result($1)`, m.ID).
		Scan(&state, &done, &failed)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, nil, fmt.Errorf("fan-in result of message %d: %w", m.ID, ErrNotParent)
	}
	if err != nil {
		return 0, 0, nil, fmt.Errorf("fan-in result of message %d: %w", m.ID, err)
	}
	if state != "fired" {
		return done, failed, nil, fmt.Errorf("fan-in result of message %d: %w (%d done, %d failed so far)",
			m.ID, ErrGroupOpen, done, failed)
	}
	if failed == 0 {
		return done, failed, nil, nil
	}
	rows, err := m.Tx.QueryContext(ctx, `SELECT workqueue_id, fanout_seq, range_lo, range_hi,
	        coalesce(dispatch_error, ''), payload FROM fanin_failed_children($1)`, m.ID)
	if err != nil {
		return 0, 0, nil, fmt.Errorf("failed children of message %d: %w", m.ID, err)
	}
	defer rows.Close()
	failedChildren = make([]FailedChild, 0, failed)
	for rows.Next() {
		var c FailedChild
		var lo, hi sql.NullInt64
		var payload []byte
		if err := rows.Scan(&c.ID, &c.Seq, &lo, &hi, &c.Error, &payload); err != nil {
			return 0, 0, nil, fmt.Errorf("failed children of message %d: scan: %w", m.ID, err)
		}
		if lo.Valid {
			c.RangeLo = &lo.Int64
		}
		if hi.Valid {
			c.RangeHi = &hi.Int64
		}
		if payload != nil {
			c.Payload = json.RawMessage(payload)
		}
		failedChildren = append(failedChildren, c)
	}
	if err := rows.Err(); err != nil {
		return 0, 0, nil, fmt.Errorf("failed children of message %d: %w", m.ID, err)
	}
	return done, failed, failedChildren, nil
}

// Page is one page of a range child's slice, handed to a PageFunc.
type Page struct {
	// From is the first id to act on, inclusive: the child's cursor.
	From int64

	// To is the end of the slice, exclusive; NULL (not Valid) when the slice runs to the int8
	// maximum. It can be passed as a query argument as it is: `($2::bigint IS NULL OR id < $2)`.
	To sql.NullInt64

	// Limit is the most rows the page may act on (PageOpts.PageSize).
	Limit int
}

// PageFunc acts on one page: the rows with ids in [p.From, p.To), in id order, at most p.Limit
// of them, in tx (the message's transaction; do not commit it). It returns how many rows it
// acted on and the id of the last (highest) one. Fewer than p.Limit means the slice is
// finished. For example:
//
//	WITH page AS (SELECT id FROM target WHERE id >= $1 AND ($2::bigint IS NULL OR id < $2)
//	                 AND cond ORDER BY id LIMIT $3),
//	     act  AS (UPDATE target t SET ... FROM page WHERE t.id = page.id RETURNING t.id)
//	SELECT count(*), coalesce(max(id), 0) FROM act
type PageFunc func(ctx context.Context, tx *sql.Tx, p Page) (n int, last int64, err error)

// PageOpts are the choices of Paginate.
type PageOpts struct {
	// PageSize is the most rows per page. 0 means PageSizeDefault.
	PageSize int

	// PagesPerRun is how many pages one run of the handler does before it hands the message
	// back to the dispatcher to be run again. 0 means 1: every page commits on its own, with
	// the cursor. More pages per run save the round trips through the dispatcher, but a crash
	// redoes the whole run (nothing of it was committed) and a run must stay well within the
	// stage's MAX_RUNTIME.
	PagesPerRun int
}

// Paginate works through a range child's slice page by page (keyset pagination;
// doc/design/fanin.md, "Split"), resuming where the last committed run stopped. It calls fn for
// up to opts.PagesPerRun pages, from the child's cursor, and keeps the cursor in
// m.State["cursor"] (the lower bound of what is left), which the message's outcome writes
// together with the pages' actions: action and cursor commit in one transaction, so a worker
// killed between runs loses nothing and redoes nothing, and one killed during a run has
// committed none of it.
//
// When the slice is finished, Paginate returns true and chooses no outcome: the handler chooses
// it (normally Done, whose entry into the terminal set counts for the parent). When pages are
// left, it chooses the outcome itself, a Defer until now, so that the dispatcher runs the
// message again at once, as a new run with a new transaction; it returns false and the handler
// must choose no outcome (return nil). A deferral is not a failure: attempts is unchanged. An
// error from fn is returned as it is wrapped, with no outcome chosen: return it to fail the
// message and roll the run back.
func (m *Message) Paginate(ctx context.Context, opts PageOpts, fn PageFunc) (finished bool, err error) {
	size, pages := opts.PageSize, opts.PagesPerRun
	if size <= 0 {
		size = PageSizeDefault
	}
	if pages <= 0 {
		pages = 1
	}
	var lo sql.NullInt64
	var hi sql.NullInt64
	err = m.Tx.QueryRowContext(ctx, `SELECT range_lo, range_hi FROM workqueue
	    WHERE workqueue_id = $1 AND status = 'running' AND stage = $2`, m.ID, m.Stage).Scan(&lo, &hi)
	if errors.Is(err, sql.ErrNoRows) {
		return false, fmt.Errorf("paginate message %d: row is no longer running at stage %s: %w", m.ID, m.Stage, ErrClaimLost)
	}
	if err != nil {
		return false, fmt.Errorf("paginate message %d: read its slice: %w", m.ID, err)
	}
	if !lo.Valid {
		return false, fmt.Errorf("paginate message %d: %w", m.ID, ErrNotRangeChild)
	}
	if m.State == nil {
		m.State = map[string]any{}
	}
	from, exhausted, err := m.cursor(lo.Int64)
	if err != nil {
		return false, fmt.Errorf("paginate message %d: %w", m.ID, err)
	}
	for page := 0; page < pages && !exhausted; page++ {
		if hi.Valid && from >= hi.Int64 {
			exhausted = true
			break
		}
		n, last, err := fn(ctx, m.Tx, Page{From: from, To: hi, Limit: size})
		if err != nil {
			return false, fmt.Errorf("paginate message %d: page from %d: %w", m.ID, from, err)
		}
		if n < 0 || n > size {
			return false, fmt.Errorf("paginate message %d: page from %d acted on %d rows, limit %d", m.ID, from, n, size)
		}
		if n > 0 {
			if last < from || (hi.Valid && last >= hi.Int64) {
				return false, fmt.Errorf("paginate message %d: page from %d ended at id %d, outside the slice [%d, %s)",
					m.ID, from, last, from, boundString(hi))
			}
			if last == math.MaxInt64 {
				m.State[cursorKey] = json.Number("9223372036854775808") // past every id
				exhausted = true
				break
			}
			from = last + 1
			m.State[cursorKey] = json.Number(strconv.FormatInt(from, 10))
		}
		if n < size {
			exhausted = true
		}
	}
	if exhausted {
		return true, nil
	}
	if err := m.DeferFor(0); err != nil {
		return false, err
	}
	return false, nil
}

// cursor returns where the child's slice resumes: m.State["cursor"] when a run committed
// one, else lo; exhausted when the cursor passed the int8 maximum.
func (m *Message) cursor(lo int64) (from int64, exhausted bool, err error) {
	v, ok := m.State[cursorKey]
	if !ok || v == nil {
		return lo, false, nil
	}
	var text string
	switch c := v.(type) {
	case json.Number:
		text = c.String()
	case string:
		text = c
	case float64:
		text = strconv.FormatFloat(c, 'f', -1, 64)
	default:
		return 0, false, fmt.Errorf("state.%s is %T %v, want an integer", cursorKey, v, v)
	}
	from, err = strconv.ParseInt(text, 10, 64)
	var numErr *strconv.NumError
	if errors.As(err, &numErr) && numErr.Err == strconv.ErrRange && !strings.HasPrefix(text, "-") {
		return 0, true, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("state.%s = %q: want an integer: %w", cursorKey, text, err)
	}
	return max(from, lo), false, nil
}

func boundString(b sql.NullInt64) string {
	if !b.Valid {
		return "unbounded"
	}
	return strconv.FormatInt(b.Int64, 10)
}
