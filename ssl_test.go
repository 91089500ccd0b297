package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"database/sql"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
)

// TestSSLServer: the dispatcher, a Go stage and a Python stage over TCP to a server that takes
// TLS, with sslmode=verify-full and the server's certificate as sslrootcert (a file the daemon
// and its workers read after the privilege drop), and with no sslmode at all (the daemon's
// default, prefer): every session of pepsi's is encrypted, and the messages run through both
// stages. The suite's other clusters have no TLS.
func TestSSLServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	py := pythonWithPsycopg(t)
	p := newPGNodes(t, 1, "pepsi-test-ssl-")
	certPEM, keyPEM := selfSignedServerCert(t)
	data := filepath.Join(p.dirs[0], "data")
	st, err := os.Stat(data)
	if err != nil {
		t.Fatal(err)
	}
	owner := st.Sys().(*syscall.Stat_t) // the account the server runs as: it must own its key
	for name, c := range map[string]struct {
		text string
		mode os.FileMode
	}{"server.crt": {certPEM, 0o644}, "server.key": {keyPEM, 0o600}} {
		f := filepath.Join(data, name)
		if err := os.WriteFile(f, []byte(c.text), c.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(f, int(owner.Uid), int(owner.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	admin := p.nodeDB(0)
	pgtest.Exec(t, admin, `ALTER SYSTEM SET ssl = on`)
	pgtest.Exec(t, admin, `SELECT pg_reload_conf()`)
	tcp := fmt.Sprintf("host=127.0.0.1 port=%s user=postgres dbname=postgres", p.ports[0])
	rootCert := writeFile(t, testDir(t), "root.crt", certPEM)
	verify := tcp + " sslmode=verify-full sslrootcert=" + rootCert
	waitFor(t, 10*time.Second, "the server taking TLS", func() bool {
		db, err := sql.Open("postgres", verify)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		return db.Ping() == nil
	})

	name := fmt.Sprintf("ssl_%d", time.Now().UnixNano()%1e9)
	pgtest.Exec(t, admin, "CREATE SCHEMA "+name)
	opts := fmt.Sprintf(" options='-c search_path=%s'", name)
	s := &testSchema{Name: name, DSN: verify + opts}
	if s.DB, err = sql.Open("postgres", s.DSN); err != nil {
		t.Fatal(err)
	}
	defer s.DB.Close()
	s.exec(t, schemaDDL(t))
	s.exec(t, runsDDL)

	prog, err := filepath.Abs(filepath.Join("python", "tests", "stage_prog.py"))
	if err != nil {
		t.Fatal(err)
	}
	marks := t.TempDir()
	os.Chmod(marks, 0o777) // the workers run as nobody when the tests run as root
	env := []string{"PATH=" + filepath.Dir(py) + string(os.PathListSeparator) + os.Getenv("PATH"),
		"PYTHONPATH=" + filepath.Dir(filepath.Dir(prog)), "TEST_MARK_DIR=" + marks}
	for round, c := range []struct{ what, dsn string }{
		{"sslmode=verify-full", verify + opts},
		{"no sslmode (prefer)", tcp + opts},
	} {
		conf := strings.Replace(baseConf(&testSchema{DSN: c.dsn}, ""), "WORKER_IDLE_TIMEOUT = 2", "WORKER_IDLE_TIMEOUT = 120", 1) +
			stageConf(t, "a", "b", "PARALLELISM = 1") + "[stage-b]\nPROGRAM = " + prog + "\nPARALLELISM = 1\n"
		d := startDaemon(t, conf, "pipeline", env...)
		enqueue(t, s, "a", 20, `{}`)
		waitFor(t, 60*time.Second, c.what+": 20 messages through a Go and a Python stage", func() bool {
			return countStatus(t, s, "done") == 20*(round+1)
		})
		// The workers stay (WORKER_IDLE_TIMEOUT): every session of pepsi's is there to see.
		var plain, encrypted, workers int
		if err := admin.QueryRow(`SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl),
		        count(*) FILTER (WHERE a.application_name LIKE 'pepsi-worker%')
		      FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE 'pepsi-%'`).
			Scan(&plain, &encrypted, &workers); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d plain, %d encrypted, %d workers", c.what, plain, encrypted, workers)
		if plain != 0 || workers < 2 || encrypted < workers+2 {
			t.Errorf("%s: %d of pepsi's sessions without TLS, %d with it, of which %d workers' (want none without, both stages' workers and the dispatcher's with)",
				c.what, plain, encrypted, workers)
		}
		d.stop()
	}
	if n := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); n != 0 {
		t.Errorf("%d (message, stage) pairs ran other than once", n)
	}
}

// selfSignedServerCert returns a certificate and key (PEM) for the server at 127.0.0.1,
// signed by itself, so that the certificate is its own root for verify-full.
func selfSignedServerCert(t *testing.T) (certPEM, keyPEM string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
}
