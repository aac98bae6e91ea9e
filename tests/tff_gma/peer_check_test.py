"""The confinement forwarder admits, among this host's users, only the worker's owner (`confinement.PeerCheck`).

Parsers and the verdict on text written here; the check on real sockets of this process; and the forwarder
itself (the confinement helper, with a stand-in worker: a stdlib script that greets and records each connection
it receives), connected to as user `nobody` and as its owner. No TensorFlow: the stand-in starts in milliseconds.
"""

import ipaddress
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from tff_gma import confinement
from tests.tff_gma import netutil

NOBODY = 65534

# (Lines as the kernel prints them, longer than the code's.)
# /proc/net/tcp as a little-endian host prints it: 127.0.0.1 is 0100007F, 10.0.0.2 is 0200000A, port 8000 is 1F40.
_TCP = textwrap.dedent('''\
      sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
       0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
       1: 0100007F:D431 0100007F:1F40 01 00000000:00000000 00:00000000 00000000 65534        0 1002 1 0000000000000000 20 4 30 10 -1
       2: 0100007F:1F40 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
       3: 0200000A:D432 0200000A:1F40 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0000000000000000
       4: 0100007F:D433 0100007F:1F40 01 00000000:00000000 00:00000000 00000000  1000        0 1004 1 0000000000000000 20 4 30 10 -1
       5: garbage
''')  # noqa: E501 (the kernel's lines, verbatim)
# ::1 is 00000000000000000000000001000000; ::ffff:127.0.0.1 is 0000000000000000FFFF00000100007F.
_TCP6 = textwrap.dedent('''\
      sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
       0: 00000000000000000000000001000000:D434 00000000000000000000000001000000:1F40 01 00000000:00000000 00:00000000 00000000  1000        0 2001 1 0000000000000000 20 4 30 10 -1
       1: 0000000000000000FFFF00000100007F:D435 0000000000000000FFFF00000100007F:1F40 01 00000000:00000000 00:00000000 00000000 65534        0 2002 1 0000000000000000 20 4 30 10 -1
''')  # noqa: E501 (the kernel's lines, verbatim)
_FIB_TRIE = textwrap.dedent('''\
    Main:
      +-- 0.0.0.0/0 3 0 5
         |-- 0.0.0.0
            /0 universe UNICAST
         +-- 127.0.0.0/8 2 0 2
            +-- 127.0.0.0/31 1 0 0
               |-- 127.0.0.0
                  /8 host LOCAL
               |-- 127.0.0.1
                  /32 host LOCAL
            |-- 127.255.255.255
               /32 link BROADCAST
         +-- 192.0.2.0/24 2 0 2
            +-- 192.0.2.0/30 2 0 2
               |-- 192.0.2.0
                  /24 link UNICAST
               |-- 192.0.2.2
                  /32 host LOCAL
            |-- 192.0.2.255
               /32 link BROADCAST
    Local:
      +-- 0.0.0.0/0 3 0 5
         |-- 10.1.0.0
            /16 host LOCAL
''')
_IF_INET6 = textwrap.dedent('''\
    00000000000000000000000000000001 01 80 10 80       lo
    20010db8000000000000000000000005 02 40 00 80     eth0
''')

little_endian = pytest.mark.skipif(sys.byteorder != 'little', reason='the /proc text here is a little-endian host\'s')


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture of that name: no TFF worker is needed here."""
  yield None


def _ip(text):
  return ipaddress.ip_address(text)


def _no_lookup():
  raise AssertionError('the local networks were read although the peer\'s socket was listed')


@little_endian
def test_parse_proc_net_tcp_and_tcp6():
  entries = confinement.parse_proc_net_tcp(_TCP)
  assert len(entries) == 5  # The header and the garbage line are skipped.
  listener, nobody = entries[0], entries[1]
  assert listener.local == (_ip('127.0.0.1'), 8000) and listener.remote == (_ip('0.0.0.0'), 0)
  assert listener.state == 0x0A and listener.uid == 0 and listener.inode == 1001
  assert nobody.local == (_ip('127.0.0.1'), 54321) and nobody.remote == (_ip('127.0.0.1'), 8000)
  assert nobody.uid == NOBODY and nobody.state == 1
  assert entries[3].local == (_ip('10.0.0.2'), 54322) and entries[3].inode == 0  # TIME_WAIT: no owner left.
  six = confinement.parse_proc_net_tcp(_TCP6)
  assert six[0].local == (_ip('::1'), 54324) and six[0].uid == 1000
  # IPv4-mapped IPv6 addresses compare as the IPv4 ones (a dual-stack listener sees '::ffff:127.0.0.1').
  assert six[1].local == (_ip('127.0.0.1'), 54325) and six[1].remote == (_ip('127.0.0.1'), 8000)


def test_parse_local_networks():
  networks = confinement.parse_fib_trie_local(_FIB_TRIE)
  assert networks == sorted(ipaddress.ip_network(n) for n in ('127.0.0.0/8', '127.0.0.1/32', '192.0.2.2/32',
                                                              '10.1.0.0/16'))
  assert confinement.parse_if_inet6(_IF_INET6) == [ipaddress.ip_network('::1/128'),
                                                   ipaddress.ip_network('2001:db8::5/128')]


@little_endian
@pytest.mark.parametrize('peer, ours, owner, admit, why', [
    (('127.0.0.1', 54321), ('127.0.0.1', 8000), 0, False, 'uid 65534'),
    (('127.0.0.1', 54321), ('127.0.0.1', 8000), NOBODY, True, f'uid {NOBODY}'),
    (('127.0.0.1', 54323), ('127.0.0.1', 8000), 1000, True, 'uid 1000'),
    (('::ffff:127.0.0.1', 54321), ('::ffff:127.0.0.1', 8000), 0, False, 'uid 65534'),
    (('::1', 54324), ('::1', 8000), 1000, True, 'uid 1000'),
    (('::1', 54324), ('::1', 8000), 0, False, 'uid 1000'),
    (('127.0.0.1', 54325), ('127.0.0.1', 8000), 0, False, 'uid 65534'),  # Listed in tcp6, mapped.
    # Sent, then closed: TIME_WAIT lists uid 0, which must not pass for a root owner.
    (('10.0.0.2', 54322), ('10.0.0.2', 8000), 0, False, 'already closed'),
], ids=['other_uid', 'owner', 'owner_1000', 'mapped_other_uid', 'ipv6_owner', 'ipv6_other_uid',
        'tcp6_mapped_other_uid', 'closed_socket_root_owner'])
def test_verdict_on_listed_sockets(peer, ours, owner, admit, why):
  entries = confinement.parse_proc_net_tcp(_TCP) + confinement.parse_proc_net_tcp(_TCP6)
  verdict = confinement.tcp_peer_verdict(peer, ours, entries, _no_lookup, owner)
  assert verdict[0] is admit and why in verdict[1], verdict


@pytest.mark.parametrize('peer, admit', [
    ('127.0.0.5', False), ('::1', False),  # Loopback.
    ('192.0.2.2', False), ('10.1.2.3', False), ('2001:db8::5', False),  # Addresses of this host.
    ('192.0.2.9', True), ('2001:db8::6', True), ('198.51.100.7', True),  # Other hosts: no uid to check.
])
def test_verdict_on_unlisted_sockets_fails_closed_for_local_addresses(peer, admit):
  networks = confinement.parse_fib_trie_local(_FIB_TRIE) + confinement.parse_if_inet6(_IF_INET6)
  ours = ('2001:db8::5', 8000) if ':' in peer else ('192.0.2.2', 8000)
  verdict = confinement.tcp_peer_verdict((peer, 40000), ours, [], lambda: networks, 0)
  assert verdict[0] is admit, verdict
  assert ('another host' if admit else 'owner is unknown') in verdict[1]


def test_peer_check_on_real_sockets():
  """This process's own TCP connection (the kernel's /proc/net/tcp) and a Unix socket pair (SO_PEERCRED)."""
  check = confinement.PeerCheck()
  with socket.socket() as server:
    server.bind(('127.0.0.1', 0))
    server.listen()
    with socket.create_connection(server.getsockname()) as client:
      accepted, _ = server.accept()
      with accepted:
        assert check.refusal(accepted) is None
        check.owner_uid = os.geteuid() + 1
        assert f'a local socket of uid {os.geteuid()}' in check.refusal(accepted)
        client.close()  # Closed by its process (FIN_WAIT2, then TIME_WAIT): no owner left.
        time.sleep(0.05)
        check.owner_uid = os.geteuid()
        refused = check.refusal(accepted)
        assert refused is not None and ('already closed' in refused or 'owner is unknown' in refused), refused
  a, b = socket.socketpair()
  with a, b:
    check.owner_uid = os.geteuid()
    assert check.refusal(a) is None
    check.owner_uid = os.geteuid() + 1
    assert f'of uid {os.geteuid()} on the Unix socket' in check.refusal(a)


@little_endian
def test_peer_check_rereads_its_tables(tmp_path):
  """The files stay open (opened before the helper leaves the host's namespace) and are read again per check."""
  for name, text in (('tcp', _TCP.replace(' 65534 ', '     0 ')), ('tcp6', ''), ('fib_trie', _FIB_TRIE),
                     ('if_inet6', _IF_INET6)):
    (tmp_path / name).write_text(text)
  check = confinement.PeerCheck(str(tmp_path))
  check.owner_uid = 0
  with socket.socket() as server:
    server.bind(('127.0.0.1', 0))  # Not 8000: the written entries (remote port 8000) do not match.
    server.listen()
    port = server.getsockname()[1]
    with socket.socket() as client:
      client.bind(('127.0.0.1', 0))
      client.connect(('127.0.0.1', port))
      accepted, _ = server.accept()
      with accepted:
        peer_port = client.getsockname()[1]
        line = (f'   7: 0100007F:{peer_port:04X} 0100007F:{port:04X} 01 00000000:00000000 00:00000000 00000000'
                f'     0        0 3001 1 0000000000000000 20 4 30 10 -1\n')
        assert 'owner is unknown' in check.refusal(accepted)  # A loopback peer not listed: refused.
        with open(tmp_path / 'tcp', 'r+') as f:  # The same file (inode), new content.
          f.seek(0, os.SEEK_END)
          f.write(line)
        assert check.refusal(accepted) is None
        with open(tmp_path / 'tcp', 'r+') as f:
          text = f.read().replace(line, line.replace('     0        0 3001', ' 65534        0 3001'))
          f.seek(0)
          f.write(text)
          f.truncate()
        assert 'a local socket of uid 65534' in check.refusal(accepted)


# --- The forwarder itself, with a stand-in worker. --------------------------------------------------------------

_STAND_IN = '''#!{python}
import socket, sys
port = int([a for a in sys.argv if a.startswith('--port=')][0].split('=', 1)[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(('127.0.0.1', port))
server.listen(16)
while True:
  conn, _ = server.accept()
  with open({record!r}, 'a') as f:
    f.write('connection\\n')
  conn.sendall(b'worker speaking')
  conn.close()
'''


# Runs the helper as uid 1000 of a user namespace (without root there): its unprivileged path, in which it makes
# a nested user namespace for its network namespace.
_UNPRIVILEGED = '''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x10000000) != 0:
  sys.exit(77)
open('/proc/self/setgroups', 'w').write('deny')
open('/proc/self/uid_map', 'w').write(f'1000 {uid} 1')
open('/proc/self/gid_map', 'w').write(f'1000 {gid} 1')
os.execv(sys.argv[1], sys.argv[1:])
'''


def _start_forwarder(tmp_path, listener, unprivileged=False):
  """The confinement helper on `listener`, forwarding to the stand-in; (helper, its log, the record, worker pid)."""
  if os.geteuid() != 0:
    pytest.skip('connecting as another user (nobody) needs root')
  record = tmp_path / 'received'
  record.write_text('')
  stand_in = tmp_path / 'stand_in_worker'
  stand_in.write_text(_STAND_IN.format(python=sys.executable, record=str(record)))
  stand_in.chmod(0o700)
  log = open(tmp_path / 'helper.log', 'wb')
  read_fd, write_fd = os.pipe()
  listener.listen(16)
  try:
    wrapper = [sys.executable, '-c', _UNPRIVILEGED] if unprivileged else []
    helper = subprocess.Popen(
        wrapper + confinement.helper_command() + [str(listener.fileno()), str(write_fd), str(stand_in)],
        pass_fds=(listener.fileno(), write_fd), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
  finally:
    os.close(write_fd)
    listener.close()
    log.close()
  with os.fdopen(read_fd) as status_pipe:
    line = status_pipe.readline()
  status = json.loads(line) if line else {}
  if unprivileged and helper.poll() == 77:
    pytest.skip('no user namespace for the test itself')
  if status.get('unavailable'):
    helper.wait(timeout=30)
    pytest.skip(f'the kernel refused a network namespace: {status.get("reason")}')
  assert status.get('ok'), (status, (tmp_path / 'helper.log').read_text())
  assert status['how'] == ('user and network namespace' if unprivileged else 'network namespace'), status
  deadline = time.monotonic() + 10  # The helper's own check that the worker serves: recorded, then forgotten.
  while 'connection' not in record.read_text() and time.monotonic() < deadline:
    time.sleep(0.01)
  record.write_text('')
  return helper, tmp_path / 'helper.log', record, int(status['pid'])


def _stop_forwarder(helper, worker_pid):
  helper.terminate()
  helper.wait(timeout=30)
  deadline = time.monotonic() + 10
  while os.path.exists(f'/proc/{worker_pid}') and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not os.path.exists(f'/proc/{worker_pid}'), 'the stand-in worker outlived its helper'


def _all_interfaces_listener():
  try:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(('::', 0))
    return sock, True
  except OSError:
    sock.close()
  sock = socket.socket()
  sock.bind(('0.0.0.0', 0))
  return sock, False


@pytest.mark.parametrize('unprivileged', [False, True], ids=['as_is', 'unprivileged'])
def test_forwarder_admits_only_the_owner_on_tcp(tmp_path, unprivileged):
  listener, ipv6 = _all_interfaces_listener()
  port = listener.getsockname()[1]
  helper, log, record, worker_pid = _start_forwarder(tmp_path, listener, unprivileged)
  owner = 1000 if unprivileged else os.geteuid()  # As the helper sees it.
  try:
    addresses = ['127.0.0.1'] + [a for a in netutil.host_addresses() if ipv6 or ':' not in a]
    addresses += ['::1'] if ipv6 and socket.has_ipv6 and os.path.exists('/proc/net/if_inet6') else []
    for address in addresses:
      # Another local user: closed before anything reaches the worker, on loopback and on the host's addresses.
      assert netutil.first_read_as((address, port), NOBODY, NOBODY) == 'eof', address
      # The owner (this test's user) is forwarded and the worker answers.
      assert netutil.first_read_as((address, port), os.geteuid(), os.getegid()) == 'data', address
    assert helper.poll() is None
  finally:
    _stop_forwarder(helper, worker_pid)
  assert record.read_text().count('connection') == len(addresses)  # The owner's only.
  refusals = [line for line in log.read_text().splitlines() if 'refused a connection' in line]
  assert len(refusals) == len(addresses), log.read_text()
  assert all(f'a local socket of uid {NOBODY}' in line and f'(uid {owner})' in line for line in refusals), refusals


@pytest.mark.parametrize('unprivileged', [False, True], ids=['as_is', 'unprivileged'])
def test_forwarder_admits_only_the_owner_on_a_unix_socket(tmp_path, unprivileged):
  directory = tmp_path / 'private'
  directory.mkdir(mode=0o700)
  path = str(directory / 'worker.sock')
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  os.chmod(path, 0o600)
  helper, log, record, worker_pid = _start_forwarder(tmp_path, listener, unprivileged)
  try:
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # nobody cannot even reach the socket (0700 directory) ...
    assert netutil.first_read_as(path, NOBODY, NOBODY) == 'connect failed'
    # ... and one that can (root's file access, but uid nobody: SO_PEERCRED) is closed by the forwarder.
    assert netutil.first_read_as(path, NOBODY, NOBODY, keep_root_files=True) == 'eof'
    assert netutil.first_read_as(path, os.geteuid(), os.getegid()) == 'data'
  finally:
    _stop_forwarder(helper, worker_pid)
  assert record.read_text().count('connection') == 1
  assert f'of uid {NOBODY} on the Unix socket' in log.read_text()
