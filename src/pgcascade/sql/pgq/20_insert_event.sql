-- pgcascade.insert_event(queue, type, data [, extra1, extra2, extra3, extra4]) -> ev_id.
-- The event belongs to the calling transaction: it is seen by consumers only if that commits,
-- in the first batch whose tick was taken after the commit.
-- One static statement looks the queue up and inserts into its current partition, so the
-- plan is cached for the session.
create or replace function pgcascade.insert_event(
    i_queue_name text, i_ev_type text, i_ev_data text,
    i_extra1 text, i_extra2 text, i_extra3 text, i_extra4 text)
returns int8
language plpgsql as $$
declare
    v_id int8;
begin
    insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)
    select nextval(q.queue_event_seq), now(), q.queue_id * 16 + q.queue_cur_table,
           i_ev_type, i_ev_data, i_extra1,
           case when i_extra2 is not null or i_extra3 is not null or i_extra4 is not null
                then row(i_extra2, i_extra3, i_extra4, null, null)::pgcascade.event_rare end
      from pgcascade.queue q
     where q.queue_name = i_queue_name and not q.queue_disable_insert
    returning ev_id into v_id;
    if v_id is null then
        perform pgcascade.find_queue(i_queue_name);
        raise exception 'queue "%" does not accept events (disable_insert is set)', i_queue_name
            using errcode = '55000';
    end if;
    return v_id;
end $$;

-- The three-argument form repeats the statement without the extras rather than calling the
-- seven-argument one: one PL/pgSQL call less per event on the hot path.
create or replace function pgcascade.insert_event(i_queue_name text, i_ev_type text, i_ev_data text)
returns int8
language plpgsql as $$
declare
    v_id int8;
begin
    insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data)
    select nextval(q.queue_event_seq), now(), q.queue_id * 16 + q.queue_cur_table, i_ev_type, i_ev_data
      from pgcascade.queue q
     where q.queue_name = i_queue_name and not q.queue_disable_insert
    returning ev_id into v_id;
    if v_id is null then
        perform pgcascade.find_queue(i_queue_name);
        raise exception 'queue "%" does not accept events (disable_insert is set)', i_queue_name
            using errcode = '55000';
    end if;
    return v_id;
end $$;
