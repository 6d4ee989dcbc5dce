-- pgq compatibility, part 6: batches.  A batch is pgcascade's: the events committed between
-- two ticks, read from every partition of the queue (pgcascade.batch_event_sql).

-- pgq.next_batch_custom(queue, consumer, min_lag, min_count, min_interval) -> the open batch,
-- opening one when a tick follows the consumer's position: the next tick, or with min_count
-- or min_interval the tick find_tick_helper picks; none while the tick is younger than
-- min_lag.  No batch: every column null.
create or replace function pgq.next_batch_custom(
    in i_queue_name text, in i_consumer_name text,
    in i_min_lag interval, in i_min_count int4, in i_min_interval interval,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8)
language plpgsql security definer set search_path = pg_catalog as $$
declare
    s pgcascade.subscription;
begin
    select sub.* into s
      from pgcascade.subscription sub
      join pgcascade.queue q on q.queue_id = sub.sub_queue
      join pgcascade.consumer c on c.co_id = sub.sub_consumer
     where q.queue_name = i_queue_name and c.co_name = i_consumer_name
       for update of sub;
    if not found then
        raise exception '%', 'Not subscriber to queue: ' || coalesce(i_queue_name, 'NULL') || '/'
                             || coalesce(i_consumer_name, 'NULL');
    end if;
    select t.tick_id, t.tick_time, t.tick_event_seq into prev_tick_id, prev_tick_time, prev_tick_event_seq
      from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = s.sub_last_tick;
    if prev_tick_id is null then
        raise exception 'PgQ corruption: Consumer % on queue % does not see tick %', i_consumer_name, i_queue_name, prev_tick_id;
    end if;
    batch_id := s.sub_batch;
    if batch_id is not null then
        select t.tick_id, t.tick_time, t.tick_event_seq into cur_tick_id, cur_tick_time, cur_tick_event_seq
          from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = s.sub_next_tick;
        return;
    end if;
    if i_min_count is null and i_min_interval is null then
        select t.tick_id, t.tick_time, t.tick_event_seq into cur_tick_id, cur_tick_time, cur_tick_event_seq
          from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id > prev_tick_id
         order by t.tick_id limit 1;
    else
        select * into cur_tick_id, cur_tick_time, cur_tick_event_seq
          from pgq.find_tick_helper(s.sub_queue, prev_tick_id, prev_tick_time, prev_tick_event_seq,
                                    i_min_count, i_min_interval);
    end if;
    if cur_tick_id is null or (i_min_lag is not null and now() - cur_tick_time < i_min_lag) then
        cur_tick_id := null; cur_tick_time := null; cur_tick_event_seq := null;
        prev_tick_id := null; prev_tick_time := null; prev_tick_event_seq := null;
        return;
    end if;
    batch_id := nextval('pgcascade.batch_id_seq');
    update pgcascade.subscription set sub_batch = batch_id, sub_next_tick = cur_tick_id, sub_active = now()
     where sub_id = s.sub_id;
end $$;

create or replace function pgq.next_batch_info(
    in i_queue_name text, in i_consumer_name text,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8)
language sql as $$ select * from pgq.next_batch_custom(i_queue_name, i_consumer_name, null, null, null) $$;

create or replace function pgq.next_batch(i_queue_name text, i_consumer_name text) returns int8
language sql as $$ select batch_id from pgq.next_batch_info(i_queue_name, i_consumer_name) $$;

-- pgq.batch_event_sql(batch) -> the SELECT of the batch's events, ordered by ev_id.
create or replace function pgq.batch_event_sql(x_batch_id bigint) returns text
language plpgsql security definer set search_path = pg_catalog as $$
begin
    perform 1 from pgcascade.subscription where sub_batch = x_batch_id;
    if not found then
        raise exception 'batch not found';
    end if;
    return pgcascade.batch_event_sql(x_batch_id);
end $$;

-- pgq.batch_event_tables(batch) -> the event tables the batch reads: every partition of the
-- queue, oldest first (a pgcascade batch reads them all; see docs/pgq-compat.md).
create or replace function pgq.batch_event_tables(x_batch_id bigint) returns setof text
language plpgsql security definer set search_path = pg_catalog as $$
declare
    q pgcascade.queue;
    k int4;
begin
    select x.* into q from pgcascade.queue x join pgcascade.subscription s on s.sub_queue = x.queue_id
     where s.sub_batch = x_batch_id;
    if not found then
        raise exception 'Cannot find data for batch %', x_batch_id;
    end if;
    for k in 1 .. q.queue_ntables loop
        return next 'pgcascade.' || pgcascade.queue_part_name(q.queue_id, (q.queue_cur_table + k) % q.queue_ntables);
    end loop;
end $$;

create or replace function pgq.get_batch_events(
    in x_batch_id bigint,
    out ev_id bigint, out ev_time timestamptz, out ev_txid bigint, out ev_retry int4, out ev_type text,
    out ev_data text, out ev_extra1 text, out ev_extra2 text, out ev_extra3 text, out ev_extra4 text)
returns setof record
language plpgsql security definer set search_path = pg_catalog as $$
begin
    return query execute pgq.batch_event_sql(x_batch_id);
end $$;

-- pgq.get_batch_cursor(batch, cursor, quick_limit [, extra_where]) -> the first quick_limit
-- events; the rest are fetched from the cursor, which stays open in the caller's transaction.
create or replace function pgq.get_batch_cursor(
    in i_batch_id bigint, in i_cursor_name text, in i_quick_limit int4, in i_extra_where text,
    out ev_id bigint, out ev_time timestamptz, out ev_txid bigint, out ev_retry int4, out ev_type text,
    out ev_data text, out ev_extra1 text, out ev_extra2 text, out ev_extra3 text, out ev_extra4 text)
returns setof record
language plpgsql as $$
declare
    v_sql text;
begin
    if i_batch_id is null or i_cursor_name is null or i_quick_limit is null then
        return;
    end if;
    v_sql := pgq.batch_event_sql(i_batch_id);
    if i_extra_where is not null then
        v_sql := 'select * from (' || replace(v_sql, ' order by 1', '') || ') _evs where ' || i_extra_where
                 || ' order by 1';
    end if;
    execute 'declare ' || quote_ident(i_cursor_name) || ' no scroll cursor for ' || v_sql;
    if i_quick_limit > 0 then
        return query execute 'fetch ' || i_quick_limit || ' from ' || quote_ident(i_cursor_name);
    end if;
end $$;

create or replace function pgq.get_batch_cursor(
    in i_batch_id bigint, in i_cursor_name text, in i_quick_limit int4,
    out ev_id bigint, out ev_time timestamptz, out ev_txid bigint, out ev_retry int4, out ev_type text,
    out ev_data text, out ev_extra1 text, out ev_extra2 text, out ev_extra3 text, out ev_extra4 text)
returns setof record
language sql strict as $$ select * from pgq.get_batch_cursor(i_batch_id, i_cursor_name, i_quick_limit, null) $$;

-- pgq.get_batch_info(batch) -> what the batch spans; every column null for a batch not open.
create or replace function pgq.get_batch_info(
    in x_batch_id bigint,
    out queue_name text, out consumer_name text, out batch_start timestamptz, out batch_end timestamptz,
    out prev_tick_id bigint, out tick_id bigint, out lag interval, out seq_start bigint, out seq_end bigint)
language sql security definer set search_path = pg_catalog as $$
    select q.queue_name, c.co_name, pt.tick_time, ct.tick_time, s.sub_last_tick, s.sub_next_tick,
           now() - ct.tick_time, pt.tick_event_seq, ct.tick_event_seq
      from (select 1) one
      left join pgcascade.subscription s on s.sub_batch = x_batch_id
      left join pgcascade.queue q on q.queue_id = s.sub_queue
      left join pgcascade.consumer c on c.co_id = s.sub_consumer
      left join pgcascade.tick pt on pt.tick_queue = s.sub_queue and pt.tick_id = s.sub_last_tick
      left join pgcascade.tick ct on ct.tick_queue = s.sub_queue and ct.tick_id = s.sub_next_tick
$$;

-- pgq.finish_batch(batch) -> 1, or 0 with a warning for a batch that is not open.
create or replace function pgq.finish_batch(x_batch_id bigint) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
begin
    perform 1 from pgcascade.subscription where sub_batch = x_batch_id;
    if not found then
        raise warning 'finish_batch: batch % not found', x_batch_id;
        return 0;
    end if;
    return pgcascade.finish_batch(x_batch_id);
end $$;
