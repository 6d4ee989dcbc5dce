-- TRUNCATE on two-way masters (docs/two-way.md, "TRUNCATE"): a table-level tombstone, ordered
-- with the rows, so that a TRUNCATE on one master and changes made concurrently on another end
-- the same on every master, whatever the order in which they arrive.
--
-- A TRUNCATE is a delete of every row the truncating master held, with one version: its commit
-- time and master, as a row's.  pgcascade.table_truncate keeps the table's latest one (by that
-- version).  The rules, the same on every master:
-- - a row the truncating master had seen when it truncated goes;
-- - a row it had not seen (changed concurrently, on this or another master) is a conflict
--   update/truncate, decided by the table's policy as an update against a delete is
--   (last-update-wins: the row stays if it is newer than the TRUNCATE);
-- - a key absent here since a TRUNCATE has that TRUNCATE as its version (if it is newer than
--   the key's own tombstone): a peer's change to it that had not seen the TRUNCATE is judged
--   against it by the same rule (the peer apply, replica/peer_apply.py).
-- "Seen" is judged as for rows, by the peer's markers (pgcascade.peer-seen) before its TRUNCATE.

-- pgcascade.record_truncate(): AFTER TRUNCATE statement trigger on a master's two-way tables: a
-- local TRUNCATE becomes the table's tombstone (origin null: this master, xid: the truncating
-- transaction, whose commit time is its version); the row versions it removed go with it.  A
-- peer's apply (pgcascade.origin set) records its own (apply_peer_truncate).
create or replace function pgcascade.record_truncate() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    v_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
begin
    if coalesce(current_setting('pgcascade.origin', true), '') <> '' then
        return null;
    end if;
    insert into pgcascade.table_truncate (table_name, origin, origin_tick, origin_time, xid)
    values (v_table, null, null, null, pg_current_xact_id())
    on conflict (table_name) do update
       set origin = null, origin_tick = null, origin_time = null, xid = excluded.xid;
    delete from pgcascade.row_version where table_name = v_table;
    return null;
end $$;

-- pgcascade.truncate_version(table, self) -> (origin, tick, time, xid) of the table's last
-- TRUNCATE, as a row version is (origin: this master's name for a local one); no row: none.
create or replace function pgcascade.truncate_version(
    i_table text, i_self text, out origin text, out origin_tick int8, out origin_time timestamptz, out xid xid8)
returns setof record
language sql stable as $$
    select coalesce(t.origin, i_self), t.origin_tick,
           coalesce(t.origin_time, pgcascade.commit_time(t.xid), '-infinity'), t.xid
      from pgcascade.table_truncate t where t.table_name = i_table
$$;

-- pgcascade.apply_peer_truncate(peer_queue, peer, self, table, dest, keys, ev_id, tick, policy,
--   winner) -> conflicts found.
-- A peer's TRUNCATE (the staged event ev_id of its batch at `tick`), applied by the rules above:
-- the rows the peer had not seen are judged by `winner` (the policy's SQL expression over
-- conflict, local_t, local_origin, local_time, ev_data, remote_time: replica/conflicts.py), the
-- others go, under an EXCLUSIVE lock of the table taken first (local writes wait, as for a
-- TRUNCATE; reads go on).  When none stays, a real TRUNCATE (captured here as one, for the
-- leaves); else a DELETE of the rest.  Then the row versions it covers go, and it becomes the table's
-- tombstone if it is newer than the one there.
create or replace function pgcascade.apply_peer_truncate(
    i_peer_queue text, i_peer text, i_self text, i_table text, i_dest regclass, i_keys text[],
    i_ev_id int8, i_tick int8, i_policy text, i_winner text)
returns int8
language plpgsql as $$
declare
    v_key_t text := pgcascade.key_array_expr('t', i_keys);
    v_time timestamptz;
    v_origins text[];
    v_ticks int8[];
    v_snapshot pg_snapshot;
    v_conflicts int8;
    v_first record;
begin
    -- no local write between the judgement and the delete: a transaction that changed a row
    -- and committed in between (the DELETE or TRUNCATE below waits for it) would lose its
    -- change here unjudged, while the masters it reaches judge it newer and keep it
    execute format('lock table %s in exclusive mode', i_dest);
    select coalesce(ev_time, '-infinity') into v_time from pg_temp.pgcascade_stage where ev_id = i_ev_id;
    -- what the peer had applied when it truncated: its markers before the TRUNCATE in this
    -- batch, else as known from the batches before
    with m as (
        select distinct on (ev_extra1) ev_extra1 as origin, ev_data::int8 as tick, ev_extra2 as snap
          from pg_temp.pgcascade_stage where ev_type = 'pgcascade.peer-seen' and ev_id < i_ev_id
         order by ev_extra1, ev_id desc),
    known as (
        select coalesce(m.origin, p.origin) as origin, coalesce(m.tick, p.seen_tick) as tick,
               coalesce(m.snap::pg_snapshot, p.seen_snapshot) as snap
          from m full join (select * from pgcascade.peer_seen where queue_name = i_peer_queue) p
            on p.origin = m.origin)
    select array_agg(origin), array_agg(tick), (array_agg(snap) filter (where origin = i_self))[1]
      into v_origins, v_ticks, v_snapshot from known;
    if to_regclass('pg_temp.pgcascade_truncate_net') is null then
        create temp table pgcascade_truncate_net (
            row_key jsonb, local_t jsonb, local_origin text, local_time timestamptz, ev_data text,
            remote_time timestamptz, conflict text, winner text
        ) on commit delete rows;
    end if;
    delete from pg_temp.pgcascade_truncate_net;
    -- the rows the peer had not seen: a peer's change (row_version) beyond the tick of its
    -- master the peer had applied; this master's own change outside the peer's snapshot of it;
    -- a first copy's rows are seen by all
    execute format(
        'insert into pg_temp.pgcascade_truncate_net (row_key, local_t, local_origin, local_time, remote_time, conflict)'
        ' select %1$s, to_jsonb(t), coalesce(v.origin, $1),'
        '        coalesce(v.origin_time, pg_xact_commit_timestamp(t.xmin)), $2, ''update/truncate'''
        '   from %2$s t'
        '   left join pgcascade.row_version v'
        '     on v.table_name = $3 and v.row_key = %1$s and v.xid = pgcascade.xid8_of(t.xmin) and not v.deleted'
        '   left join unnest($4::text[], $5::int8[]) m(origin, tick) on m.origin = v.origin'
        '  where case when v.origin is not null then v.origin <> $6 and v.origin_tick > coalesce(m.tick, -1)'
        '             when exists (select 1 from pgcascade.peer_copy c'
        '                           where c.table_name = $3 and c.xid = pgcascade.xid8_of(t.xmin)) then false'
        '             else not coalesce(pg_visible_in_snapshot(pgcascade.xid8_of(t.xmin), $7), false) end',
        v_key_t, i_dest)
        using i_self, v_time, i_table, v_origins, v_ticks, i_peer, v_snapshot;
    execute format('update pg_temp.pgcascade_truncate_net set winner = %s', i_winner);
    select * into v_first from pg_temp.pgcascade_truncate_net n
     where n.winner is distinct from 'remote' and n.winner is distinct from 'local' limit 1;
    if found then
        raise exception 'update/truncate conflict on % key % from %: the policy is "%"', i_table,
            v_first.row_key, i_peer, i_policy using
            hint = 'change the policy (add-peer --conflict) or the row, then the worker goes on from this batch';
    end if;
    insert into pgcascade.conflict (queue_name, table_name, conflict_type, row_key, local_row, remote_row,
                                    local_origin, remote_origin, local_time, remote_time, policy, winner, tick_id)
    select i_peer_queue, i_table, n.conflict, n.row_key, n.local_t, null, n.local_origin, i_peer,
           n.local_time, n.remote_time, i_policy, n.winner, i_tick
      from pg_temp.pgcascade_truncate_net n;
    get diagnostics v_conflicts = row_count;
    if not exists (select 1 from pg_temp.pgcascade_truncate_net where winner = 'local')
       and not exists (select 1 from pg_constraint where confrelid = i_dest and conrelid <> i_dest) then
        execute format('truncate %s', i_dest);
    else  -- rows stay, or another table's foreign key points here (TRUNCATE would refuse)
        execute format('delete from %s t where not exists (select 1 from pg_temp.pgcascade_truncate_net n'
                       ' where n.winner = ''local'' and n.row_key = %s)', i_dest, v_key_t);
    end if;
    -- the versions it covers: of the rows gone, and the tombstones older than it
    delete from pgcascade.row_version v
     where v.table_name = i_table
       and not exists (select 1 from pg_temp.pgcascade_truncate_net n
                        where n.winner = 'local' and n.row_key = v.row_key)
       and not (v.deleted and (coalesce(v.origin_time, pgcascade.commit_time(v.xid), '-infinity'),
                               coalesce(v.origin, i_self)) > (v_time, i_peer));
    insert into pgcascade.table_truncate as tt (table_name, origin, origin_tick, origin_time, xid)
    values (i_table, i_peer, i_tick, v_time, pg_current_xact_id())
    on conflict (table_name) do update
       set origin = excluded.origin, origin_tick = excluded.origin_tick, origin_time = excluded.origin_time,
           xid = excluded.xid
     where (excluded.origin_time, excluded.origin)
           > (coalesce(tt.origin_time, pgcascade.commit_time(tt.xid), '-infinity'), coalesce(tt.origin, i_self));
    return v_conflicts;
end $$;

-- Two-way tables made before migration 17 get their TRUNCATE trigger (two_way_table makes it now).
do $$
declare
    r record;
begin
    for r in select s.table_name, s.key_columns from pgcascade.set_table s
              where exists (select 1 from pg_trigger t
                             where t.tgrelid = to_regclass(s.table_name) and t.tgname = '_pgcascade_tombstone_key')
                and not exists (select 1 from pg_trigger t
                                 where t.tgrelid = to_regclass(s.table_name) and t.tgname = '_pgcascade_tombstone_trunc')
    loop
        perform pgcascade.two_way_table(r.table_name::regclass, r.key_columns, true);
    end loop;
end $$;
