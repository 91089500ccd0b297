// crash_committed_test.go: a worker that dies after its head message's outcome committed.

package main

import (
	"bufio"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// commitThenDieWorker is a raw stage: it finishes each message with the guarded UPDATE and
// answers 0, except a message whose payload says "die": that one it finishes, commits, and
// then exits 3 before its status line, as a worker killed right after its commit does.
func commitThenDieWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	stage := os.Getenv("PEPSI_STAGE")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var die bool
		err := db.QueryRow(`UPDATE workqueue SET status = 'done'
			 WHERE workqueue_id = $1 AND status = 'running' AND stage = $2
			RETURNING coalesce((payload->>'die')::boolean, false)`, strings.TrimSpace(in.Text()), stage).Scan(&die)
		if err != nil {
			fmt.Printf("1 %v\n", err)
			continue
		}
		if die {
			os.Exit(3)
		}
		fmt.Println("0 done")
	}
	return 0
}

func init() { testWorkers["commit-then-die"] = commitThenDieWorker }

// TestCrashAfterCommitCounted: the head's outcome had committed, so the dispatcher's guarded failure
// write changes nothing; the log says so, the message is counted processed, not crashed, and
// it is not failed (no attempt, no dispatch_error).
func TestCrashAfterCommitCounted(t *testing.T) {
	s := newTestSchema(t)
	conf := baseConf(s, "") + stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 1")
	d := startDaemon(t, conf, "commit-then-die")
	enqueue(t, s, "a", 1, `{}`)
	enqueue(t, s, "a", 1, `{"die": true}`)
	d.waitLog("worker died after its head message's outcome had committed; the message is not failed", 60*time.Second)
	d.stop()
	var status string
	var attempts int
	var hasErr bool
	if err := s.DB.QueryRow(`SELECT status, attempts, state ? 'dispatch_error' FROM workqueue
		 WHERE payload->>'die' = 'true'`).Scan(&status, &attempts, &hasErr); err != nil {
		t.Fatal(err)
	}
	if status != "done" || attempts != 0 || hasErr {
		t.Errorf("the committed message: status %s, attempts %d, dispatch_error %v; want done, 0, none", status, attempts, hasErr)
	}
	var processed, crashed, failed int
	if err := s.DB.QueryRow(`SELECT processed, crashed, failed FROM stage_stats WHERE stage = 'a'`).
		Scan(&processed, &crashed, &failed); err != nil {
		t.Fatal(err)
	}
	if processed != 2 || crashed != 0 || failed != 0 {
		t.Errorf("stage_stats: processed %d, crashed %d, failed %d; want 2, 0, 0", processed, crashed, failed)
	}
	if strings.Contains(d.log.String(), `msg="message failed"`) {
		t.Errorf("a message was logged as failed:\n%s", d.log.String())
	}
}
